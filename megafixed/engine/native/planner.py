"""How ``megafixed plan`` sizes the torch engine's layouts (``megafixed.engine.protocols.Planner``):
FSDP2 shards parameters, gradients and optimizer state over the DP shard degree (``dp /
dp_replicate``), as ZeRO-3, keeping fp32 masters and fp32 gradients (``megafixed.parallel.memory``'s
docstring has the whole account). Light: arithmetic only."""
from __future__ import annotations

from ..protocols import PlanNotes

COLUMN = ("FSDP", 5, ("dp_replicate", "dp_shard"))  # HSDP replicate x shard
NOTES = PlanNotes(  # its reductions per micro batch are in the intro
    intro=("train.engine=torch: FSDP2 shards params, grads and optimizer state over DP as ZeRO-3 does (FSDP column: "
           "HSDP replicate x shard, torch_engine.dp_replicate; R x 1 = plain replication); fp32 masters and grads, "
           "reduce-scattered every micro batch, all-reduced over the replicas once per step; pp > 1 through "
           "torch.distributed.pipelining (its schedule reduces once, after the last microbatch)"))


def pp_partitions(pp: int) -> tuple:
    return ("parameters",)  # one split (schedules.stage_spans), not DeepSpeed's two balancing rules


def sharding_options(dp: int) -> list:
    return [r for r in range(1, dp + 1) if dp % r == 0]  # each HSDP replicate degree (1 = FSDP over all DP)


def make_layout(cfg, tp, pp, dp, replicate, micro, sp, part):
    from ...parallel.memory import Layout

    accum = cfg.train.global_batch // (micro * dp)
    par = cfg.parallel
    # "zero" shows the ZeRO stage FSDP2's sharding equals
    return Layout(tp, pp, dp, 3 if dp // replicate > 1 else 0, micro, sp, cfg.train.activation_checkpointing, part,
                  cfg.train.engine, replicate, accum, cfg.torch_engine.reshard_after_forward, par.pp_schedule,
                  par.vpp, par.pp_input_head_layers, float8=cfg.train.float8)


def stage_bounds(weights: list, parts: int, method: str) -> list[int]:
    """Its pipeline splits in its own plan (``pipeline_estimate``; ``schedules.stage_spans``), not by a partitioner."""
    raise NotImplementedError("train.engine=torch splits its pipeline in its own plan (pipeline_estimate)")


def model_state_bytes(n_params: int, layout, precision: str) -> tuple[float, float, float]:
    """fp32 masters, fp32 gradients and Adam state, all sharded; gradients reduce-scattered every
    micro batch (step.py), so accumulation holds no unsharded copy (under HSDP the shards are summed
    in FSDP2's partial buffer of the same size until the replicas' all-reduce)."""
    shard = layout.dp_shard
    return n_params * 4 / shard, n_params * 4 / shard, n_params * 8 / shard


def working_param_bytes(m, layout, n_params: int, precision: str, act_bytes: int) -> float:
    """FSDP2's unsharded working parameters in the compute dtype: the block computing plus the one
    prefetched, and the root's and the head's groups, which stay gathered from forward to backward
    (native/build.py); or every group. One DP rank has no FSDP2: autocast's 16-bit copies of every
    weight live until backward."""
    if not (layout.dp_shard > 1 or precision != "fp32"):
        return 0.0
    from ...parallel.memory import layer_params

    per_layer = layer_params(m, layout.tp)
    edges = per_layer[0] + per_layer[-1]  # the input (table) and the head: root and head groups
    # no reshard after forward under PP either: the schedule interleaves microbatches
    everything = not layout.reshard_after_forward or layout.dp_cp == 1 or layout.pp > 1
    working = n_params if everything else min(n_params, 2 * per_layer[1] + edges)
    return working * act_bytes - float8_gather_saving(m, layout, n_params, working, act_bytes)


def float8_gather_saving(m, layout, n_params: int, working: float, act_bytes: int) -> float:
    """train.float8=tensorwise under FSDP2 (dp_shard > 1) gathers the blocks' Linear weights in float8
    (1 byte, not ``act_bytes``): the gathered blocks' matrices shrink by that (float8.py). Not modelled:
    the per-weight scale and amax scalars (bytes), and each GEMM's transient float8 copies of its
    input, weight and output gradient (one Linear's at a time; rowwise adds one fp32 scale per row);
    torchao saves the high-precision input for backward, so activations are unchanged. A Linear left in
    high precision (dims not divisible by 16) is counted as converted."""
    if layout.float8 != "tensorwise" or layout.dp_shard == 1:
        return 0.0
    from ...parallel.memory import tp_param_counts

    counts = tp_param_counts(m)
    block_matrices = counts.block_sharded // layout.tp  # the Linear weights (and any column bias)
    gathered_blocks = m.n_layers if working >= n_params else min(2, m.n_layers)
    return gathered_blocks * block_matrices * (act_bytes - 1)


def reduction_phase(m, layout, n_params: int, precision: str, layer: float) -> tuple[float, float | None, float]:
    """(extra gradient buffers, the gradients held at the loss backward, what the backward's end holds
    beside all of them): ``parallel.memory.Estimate``'s two peaks.

    With one micro batch per step no gradient exists at the loss backward (the step before dropped
    them, ``zero_grad(set_to_none=True)``): the activations peak alone (measured under ``plan --fake``
    at 1.7B, 64x1, micro batch 8: no gradient at the peak, 30.6 GiB where gradients + activations
    gave 37.2). The backward ends holding every gradient, the first block's activations (recomputed
    under checkpointing) and that block's reduction: its unsharded gradients in the compute dtype
    and FSDP2's fp32 reduce-scatter input and output. From the second micro batch on the gradients
    (HSDP: FSDP2's partial sums of the same size) are held throughout: one peak, as the paper counts."""
    if layout.accum > 1:
        return 0.0, None, 0.0
    from ...parallel.memory import layer_params

    e = 4 if precision == "fp32" else 2
    block = layer_params(m, layout.tp)[1]
    return 0.0, 0.0, layer + block * (e + 4 + 4 / layout.dp_shard)


def rank_sharding(layout) -> int:
    return layout.dp_shard  # the smallest shard degree: more replication, fewer all-gathers



LAYOUT_KEYS = ("torch_engine.dp_replicate",)  # what a row sets beyond the engine-neutral keys (plan --pick)


def sharding_overrides(layout) -> list[str]:
    return [f"torch_engine.dp_replicate={layout.dp_replicate}"]


def dp_traffic(out, m, layout, n_params: int, blocks: int, precision: str) -> None:
    """FSDP2's collectives of one step (``parallel.traffic``): every micro batch all-gathers each
    block in the compute dtype in forward and, resharded after it, again in backward; the head and
    the root (their groups stay gathered to backward) once each. Every micro batch reduce-scatters
    its fp32 gradients over the shard degree (step.py: FSDP2's default), and the replicate axis
    (HSDP's, plain replication's) all-reduces the summed shards once per step, after the last micro
    batch (``step._reduce_replicas``): its bytes do not grow with the accumulation. Sizes are per TP
    rank (FSDP2 shards TP's DTensors locally).

    Under PP the schedule drives FSDP2 (``pipelining``'s ``backward_maybe_with_nosync``): the stage's
    parameters are gathered once and stay so across the microbatches, and its gradients are
    accumulated unsharded and reduced once, at the last microbatch (measured under ``plan --fake``)."""
    from ...parallel.memory import layer_params

    shard, replicate = layout.dp_shard, layout.dp_replicate
    e = 4 if precision == "fp32" else 2
    if layout.pp > 1:
        if shard > 1:
            out.add("dp_shard", "all_gather", n_params * e, shard)
            out.add("dp_shard", "reduce_scatter", n_params * 4, shard)
        out.add("dp_replicate", "all_reduce", n_params * 4 / shard, replicate)
        return
    per_layer = layer_params(m, layout.tp)
    if shard > 1:
        block_gathers = 2 if layout.reshard_after_forward else 1
        gathered = blocks * per_layer[1] * block_gathers + per_layer[0] + per_layer[-1]
        out.add("dp_shard", "all_gather", layout.accum * gathered * e, shard)
        out.add("dp_shard", "reduce_scatter", layout.accum * n_params * 4, shard)
    out.add("dp_replicate", "all_reduce", n_params * 4 / shard, replicate)


def fake_refusal(layout):
    """Why ``megafixed plan --fake`` cannot measure this layout, or None (``fake_measure.py``)."""
    if layout.pp > 1 and layout.vpp > 1:
        return ("a pipeline with several stages per rank (vpp > 1) is not measured under fake tensors; "
                "--fake measures vpp=1 schedules")
    return None



def pipeline_estimate(m, seq: int, layout, precision: str, masks: bool):
    """Its own pipeline's ``Estimate`` (``pipeline_plan.py``: its split, its schedule's microbatches in flight)."""
    from .pipeline_plan import torch_pipeline_estimate

    return torch_pipeline_estimate(m, seq, layout, precision, masks)
