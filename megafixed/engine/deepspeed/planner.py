"""How ``megafixed plan`` sizes the DeepSpeed engine's layouts (``megafixed.engine.protocols.Planner``):
the ZeRO arithmetic of ``megafixed.parallel.memory`` (the model-state bytes per stage 0-3), DeepSpeed's
own buffers as its config sets them (``zero_buffers.py``: the reduction bucket, ZeRO-3's gathered and
persistent parameters, the reduction's copies) and its column of the table. Light: arithmetic only.
Checked against the real step (``measure_memory.py``, tests/test_deepspeed_memory.py)."""
from __future__ import annotations

from ..protocols import PlanNotes

COLUMN = ("ZeRO", 4, ("zero",))  # the sharding column: title, width, the Layout fields it shows

_GRADS = (" (grads = {held}, and ZeRO's reduction bucket; a row's peak is the larger of the loss backward's "
          "and the gradient reduction's, so its columns can add up to more than its total)")
NOTES = PlanNotes(
    accumulation=("ZeRO per micro batch: stages 0-1 reduce the gradients once per step, at the accumulation boundary "
                  "(the full gradients wait in between), {grad_gb:.1f} GB per rank at any accumulation; stages 2-3 "
                  "reduce-scatter each micro batch's gradients as its backward ends (their gradients are partitioned; "
                  "DeepSpeed has no setting that defers it: that is ZeRO-1), {grad_gb:.1f} GB per micro batch, "
                  "{step_gb:.1f} GB per step at {micro_batches} micro batches (TP 1, PP 1, DP {gpus}, micro batch 1)"),
    grads={"16-bit": _GRADS.format(held="16-bit gradients + the fp32 accumulators the trainer uses"),
           "fp32": _GRADS.format(held="gradients")})


def pp_partitions(pp: int) -> tuple:
    # Both balancing rules under PP: with fixed codes, balancing parameters moves blocks onto
    # stage 0, which holds the most in-flight micro batches.
    return ("parameters", "type:Block") if pp > 1 else ("parameters",)


def sharding_options(dp: int) -> tuple:
    return (0, 1, 2, 3)  # each ZeRO stage


def make_layout(cfg, tp, pp, dp, stage, micro, sp, part):
    from ...parallel.memory import Layout

    return Layout(tp, pp, dp, stage, micro, sp, cfg.train.activation_checkpointing, part, cfg.train.engine,
                  accum=max(cfg.train.global_batch // (micro * dp), 1), reduce_bucket=cfg.zero.reduce_bucket_size)


def stage_bounds(weights: list, parts: int, method: str) -> list[int]:
    """Its pipeline's split, by DeepSpeed's own partitioner (``PipelineModule``'s)."""
    from .pipeline import partition

    return partition(weights, parts, method)


def model_state_bytes(n_params: int, layout, precision: str) -> tuple[float, float, float]:
    """ZeRO-1 divides the optimizer state by DP, ZeRO-2 also the gradients, ZeRO-3 also the
    parameters. 16-bit runs accumulate gradients in fp32 (``data_types.grad_accum_dtype``, which the
    trainer sets, as Megatron's main_grad): at ZeRO 0-1 a 16-bit gradient per parameter plus the fp32
    accumulator, 6 bytes; at ZeRO 2-3 the fp32 partition alone, 4 bytes over DP (the 16-bit gradients
    pass through DeepSpeed's fixed-size bucket instead: ``reduction_phase``). The optimizer state is
    the fp32 master partition and Adam's m and v, 12 bytes, in every precision."""
    dp, z = layout.dp_cp, layout.zero  # ZeRO partitions over data x context parallel ranks
    if precision == "fp32":
        # ZeRO's optimizers keep an fp32 master partition apart from the fp32 parameters even here
        # (measured: 4 bytes per parameter over DP beside Adam's 8); without ZeRO Adam steps the parameters
        pb, gb, ob = 4, 4, (12 if z >= 1 else 8)
    else:
        pb, gb, ob = 2, (4 if z >= 2 else 2 + 4), 12
    params = n_params * pb / (dp if z >= 3 else 1)
    grads = n_params * gb / (dp if z >= 2 else 1)
    opt = n_params * ob / (dp if z >= 1 else 1)
    return params, grads, opt


def zero3_working_elements(layers: list) -> int:
    """Elements ZeRO-3 holds gathered at its forward-to-backward peak, beyond the partitions: the
    persistent parameters (at most ``PERSISTENCE_THRESHOLD`` elements: kept whole), the layers whose
    reuse falls within ``MAX_REUSE_DISTANCE`` (the layers after them, traversed in forward and again
    in backward), and the flat buffer of one prefetch. ``layers``: each layer's parameter sizes."""
    from .zero_buffers import MAX_REUSE_DISTANCE, PERSISTENCE_THRESHOLD, PREFETCH_BUCKET

    persistent = sum(n for layer in layers for n in layer if n <= PERSISTENCE_THRESHOLD)
    sharded = [sum(n for n in layer if n > PERSISTENCE_THRESHOLD) for layer in layers]
    totals = [sum(layer) for layer in layers]
    kept = sum(s for j, s in enumerate(sharded) if 2 * sum(totals[j + 1:]) < MAX_REUSE_DISTANCE)
    return persistent + kept + min(sum(sharded), PREFETCH_BUCKET)


def working_param_bytes(m, layout, n_params: int, precision: str, act_bytes: int) -> float:
    """ZeRO-3's gathered parameters (``zero3_working_elements``) in the compute dtype; ZeRO 0-2 compute
    on the whole parameters they hold."""
    if layout.zero < 3:
        return 0.0
    from ...parallel.memory import layer_param_sizes

    return zero3_working_elements(layer_param_sizes(m, layout.tp)) * act_bytes


def reduction_phase(m, layout, n_params: int, precision: str, layer: float = 0.0) -> tuple[float, float | None, float]:
    """DeepSpeed's gradient buffers (added to ``grads``), the gradient bytes held at the loss
    backward, and the transient copies of its reduction (``Estimate.grads_in_backward`` and
    ``reduction``), measured on 2 ranks in bf16 (``tests/test_deepspeed_memory.py``):

    - ZeRO-1 bf16 (DeepSpeed's BF16 optimizer): no bucket; the fp32 accumulators stay from step to
      step, the 16-bit gradients from one micro batch to the next until the step; after the last
      backward the engine all-reduces the fp32 gradients, flattened in buckets of
      ``BF16_ALLREDUCE_BUCKET`` elements and cast to 16 bits for the wire.
    - ZeRO-1 fp32/fp16, ZeRO-2 and -3: the reduction bucket of ``zero.reduce_bucket_size`` elements in
      the compute dtype (ZeRO-3 allocates it at start, the others at each backward), and one bucket's
      flattened copy while it is reduced. ZeRO-2's fp32 partition is made at the step's first reduction
      and freed by the step (held at a loss backward from the second micro batch on); ZeRO-3's is
      allocated at start.

    fp32 was measured once too (within 4%, docs/parallelism.md); fp16 (no CPU run) follows the code
    paths of ZeRO's optimizer, as bf16 does at ZeRO 2-3; pipeline stages (ZeRO-1) are not measured.
    """
    from .zero_buffers import BF16_ALLREDUCE_BUCKET

    z, e, n = layout.zero, (4 if precision == "fp32" else 2), n_params
    if z == 0:
        return 0.0, None, 0.0
    accumulating = layout.accum > 1
    if z == 1 and precision == "bf16":
        return 0.0, n * (4 + (e if accumulating else 0)), (4 + e) * min(n, BF16_ALLREDUCE_BUCKET)
    bucket = layout.reduce_bucket * e
    if z >= 3:
        return bucket, None, e * min(layout.reduce_bucket, n)
    held = model_state_bytes(n, layout, precision)[1] if accumulating else 0.0
    return bucket, bucket + held, e * min(layout.reduce_bucket, n)


def pipeline_estimate(m, seq: int, layout, precision: str, masks: bool):
    return None  # its 1F1B pipeline is the engine-neutral estimate's (``parallel.memory.estimate``)


def rank_sharding(layout) -> int:
    return max(layout.zero, 1)  # ZeRO 0 and 1 move the same bytes, so they tie



LAYOUT_KEYS = ("zero.stage", "parallel.pp_partition")  # what a row sets beyond the engine-neutral keys (plan --pick)


def sharding_overrides(layout) -> list[str]:
    split = [f"parallel.pp_partition={layout.partition}"] if layout.pp > 1 else []
    return [f"zero.stage={layout.zero}", *split]


def dp_traffic(out, m, layout, n_params: int, blocks: int, precision: str) -> None:
    """ZeRO's collectives of one step (``parallel.traffic``), in the communication dtype (the
    compute dtype: DeepSpeed reduces 16-bit gradients). ZeRO-0 and -1 reduce once per step, at the
    accumulation boundary (``reduce_ready_partitions_and_remove_grads`` waits for it; the full
    gradients are held between micro batches): ZeRO-0 (and ZeRO-1 in bf16) all-reduces them, ZeRO-1
    otherwise reduce-scatters them. ZeRO-2 and -3 reduce-scatter every micro batch's gradients as
    its backward ends (their gradients are partitioned: holding them unreduced is what ZeRO-1 is;
    DeepSpeed has no setting that defers it), so their reduction grows with the accumulation. ZeRO 1-2
    all-gather the updated 16-bit parameters once per step; ZeRO-3 instead gathers every parameter
    in forward and again in backward, per micro batch. Not measured: DeepSpeed cannot run under fake
    tensors (``fake_refusal``)."""
    dp, z = layout.dp_cp, layout.zero  # ZeRO partitions over data x context parallel ranks
    e = 4 if precision == "fp32" else 2
    if z == 0:
        out.add("dp", "all_reduce", n_params * e, dp)
        return
    if z == 1 and precision == "bf16":
        # DeepSpeed's BF16 optimizer all-reduces the whole gradient (cast to 16 bits for the wire; seen in
        # the measured step, reduction_phase) before each rank steps its partition and gathers the rest
        out.add("dp", "all_reduce", n_params * e, dp)
    else:
        out.add("dp", "reduce_scatter", n_params * e * (layout.accum if z >= 2 else 1), dp)
    out.add("dp", "all_gather", n_params * e * (2 * layout.accum if z >= 3 else 1), dp)


def fake_refusal(layout):
    """DeepSpeed's engine cannot run under ``FakeTensorMode``: it talks to real process groups
    through ``deepspeed.comm`` and allocates through its accelerator (flat fp32 partitions, pinned
    buffers, CUDA streams), none of which a fake tensor or a fake process group stands in for."""
    return ("not measurable under fake tensors: DeepSpeed's engine runs real collectives (deepspeed.comm) "
            "and accelerator allocations; its model is checked against its real step on 2 CPU ranks instead "
            "(ZeRO 1-3, bf16: tests/test_deepspeed_memory.py)")
