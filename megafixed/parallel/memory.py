"""Memory per GPU of a (TP, PP, DP, ZeRO, micro-batch) layout, before launching anything.

Model states (per parameter; ZeRO paper, Rajbhandari et al. 2020):

=============  ======  =====  ==========================================
precision      params  grads  optimizer state
=============  ======  =====  ==========================================
bf16 / fp16    2       2+4    12 (fp32 master copy + Adam m and v)
fp32           4       4      8 (Adam m and v; the params are the master)
=============  ======  =====  ==========================================

ZeRO-1 divides the optimizer state by DP, ZeRO-2 also the gradients, ZeRO-3 also the parameters.

``train.engine=torch`` (FSDP2) shards all three over the DP shard degree (``dp / dp_replicate``;
HSDP replicates across ``dp_replicate`` groups), as ZeRO-3, but keeps different bytes: the sharded
parameters are the fp32 masters (4), gradients are reduce-scattered in fp32 (4), Adam m and v (8) --
16 per parameter in bf16 and fp32 alike, against DeepSpeed bf16's 20. On top, the unsharded working
copies in the compute dtype: two blocks' (the one computing and the one prefetched) plus the
input's and the head's (gathered from forward to backward) with ``torch_engine.reshard_after_forward=
true``, the whole stage's with false or under pipeline parallelism. Gradient accumulation adds
nothing: FSDP2 reduce-scatters every micro batch's gradients into the sharded fp32 ones (as
torchtitan does), instead of holding the unsharded fp32 gradients between reductions.

The torch engine's pipeline (``parallel.pp_schedule``, ``parallel.vpp``) splits the layers as
``engine.native.schedules.stage_spans`` does, and the microbatches each stage holds in flight are
read from the schedule's own action table (``parallel.bubble``): 1F1B's ``pp - i`` on stage ``i``,
GPipe's all of them, the interleaved and zero-bubble schedules' own counts; a rank adds up its
stages'. The bubble fraction is reported beside it.

TP divides every sharded matrix by ``tp`` (norms stay replicated); PP keeps one stage's layers,
split by DeepSpeed's own partitioner (``parallel.pp_partition``).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models"): per layer and micro batch, with 16-bit activations, ``s*b*h*(34 + 5*a*s/h)`` bytes, of
which ``10*s*b*h`` are replicated across TP ranks and the rest split by ``t``; sequence parallelism
splits all of it. We write the 34 out term by term so that a SwiGLU MLP and any FFN width are
counted, and drop the ``5*a*s^2*b`` attention-score term because the model uses
``scaled_dot_product_attention`` (flash / memory-efficient kernels keep no s x s matrices); see
``layer_activation_bytes`` for the two places where this model saves more than the paper assumes.
Full activation checkpointing stores only each layer's input (``2*s*b*h``, split by ``t`` under SP)
plus one layer's activations during its recomputation. Under 1F1B the first stage holds ``pp``
micro batches in flight, so it holds activations for ``pp * L/pp = L`` layers (the paper's point
that PP does not shrink activation memory). The last stage adds the logits (fp32 for the loss,
``4*s*b*V/t``).

The estimates are checked against measured tensor bytes on CPU in ``tests/test_parallel_plan.py``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

GiB = 1024 ** 3


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 1
    micro_batch: int = 1
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    partition: str = "parameters"  # parallel.pp_partition (only matters with pp > 1)
    engine: str = "deepspeed"  # train.engine; "torch": FSDP2 over dp / dp_replicate (``zero`` unused)
    dp_replicate: int = 1  # torch_engine.dp_replicate (HSDP's replicate degree)
    accum: int = 1  # micro batches per step (the pipeline's microbatches)
    reshard_after_forward: bool = True  # torch_engine.reshard_after_forward
    schedule: str = "1F1B"  # parallel.pp_schedule (the torch engine's; DeepSpeed runs 1F1B)
    vpp: int = 1  # parallel.vpp: pipeline stages per rank
    edge: int = 1  # parallel.pp_input_head_layers

    @property
    def dp_shard(self) -> int:
        """The degree the model states are sharded over (FSDP2's shard dim; ZeRO's dp)."""
        return self.dp // self.dp_replicate if self.engine == "torch" else self.dp


@dataclass
class ParamCounts:
    """Trainable parameters by part, unsharded."""
    input: int
    block_sharded: int  # per block: matrices split by TP
    block_replicated: int  # per block: norms and row-parallel biases (copied on every TP rank)
    head_sharded: int  # output projection (vocabulary rows)
    head_replicated: int  # final norm
    n_layers: int

    @property
    def total(self) -> int:
        return (self.input + self.n_layers * (self.block_sharded + self.block_replicated)
                + self.head_sharded + self.head_replicated)


_COUNTS: dict[str, ParamCounts] = {}


def tp_param_counts(m) -> ParamCounts:
    """Parameter counts of ``GPT(m)``, split into TP-sharded and replicated parts.

    Built on the meta device (no memory) from the real model, and classified with the same
    ``sharded_dim`` rule that ``apply_tp`` and the checkpoint converter use, so the plan cannot
    drift from the model code.
    """

    from ..model.gpt import meta_gpt
    from .tensor import sharded_dim

    key = repr(m)  # the planner asks for the same model hundreds of times
    if key in _COUNTS:
        return _COUNTS[key]
    model = meta_gpt(m)
    unique = {id(p): (name, p) for name, p in model.named_parameters()}.values()
    parts = {"input": 0, "block_sharded": 0, "block_replicated": 0, "head_sharded": 0, "head_replicated": 0}
    for name, p in unique:
        sharded = sharded_dim(name) is not None
        if name.startswith("input."):
            parts["input"] += p.numel()
        elif name.startswith("blocks.0."):
            parts["block_sharded" if sharded else "block_replicated"] += p.numel()
        elif name.startswith("head."):
            parts["head_sharded" if sharded else "head_replicated"] += p.numel()
    _COUNTS[key] = ParamCounts(n_layers=m.n_layers, **parts)
    return _COUNTS[key]


def layer_params(m, tp: int = 1) -> list[int]:
    """Parameters of each pipeline layer on one TP rank: input, blocks..., head."""
    c = tp_param_counts(m)
    block = c.block_sharded // tp + c.block_replicated
    return [c.input // tp] + [block] * m.n_layers + [c.head_sharded // tp + c.head_replicated]


def stage_bounds(m, layout: Layout, partition: str = "parameters") -> list[int]:
    """Layer boundaries of the pipeline stages, computed by DeepSpeed's own partitioner with the
    same weights ``PipelineModule`` uses (so the plan matches the real split)."""
    from ..engine import stage_bounds as engine_stage_bounds

    n_items = m.n_layers + 2
    if layout.pp == 1:
        return [0, n_items]
    if partition == "uniform":
        return engine_stage_bounds([1] * n_items, layout.pp, "uniform")
    if partition == "type:Block":
        weights = [0] + [1] * m.n_layers + [0]
    else:
        weights = layer_params(m, layout.tp)
    return engine_stage_bounds(weights, layout.pp, "balanced")


def blocks_per_stage(m, layout: Layout, partition: str = "parameters") -> list[int]:
    bounds = stage_bounds(m, layout, partition)
    return [sum(1 for i in range(lo, hi) if 1 <= i <= m.n_layers) for lo, hi in zip(bounds, bounds[1:])]


def stage_params(m, layout: Layout, partition: str = "parameters") -> list[int]:
    """Parameters held by one GPU of each pipeline stage."""
    per_layer = layer_params(m, layout.tp)
    bounds = stage_bounds(m, layout, partition)
    return [sum(per_layer[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]


def layer_activation_bytes(m, seq: int, micro: int, tp: int, sp: bool, act_bytes: int = 2,
                           dropout_masks: bool = True) -> float:
    """Bytes one transformer layer keeps for backward, per micro batch, on one TP rank.

    The paper's ``34*s*b*h`` term by term, adjusted to what this model's autograd graph really
    saves (measured with saved-tensor hooks in the tests): K and V are saved after the GQA
    ``repeat_interleave`` (so at full head count), the attention kernel keeps its output and a
    float32 log-sum-exp, and the ``wo`` input is a separate (transposed) copy of that output.
    """
    s, b, h, f = seq, micro, m.d_model, m.ffn_dim
    e = act_bytes
    mask = 1 if dropout_masks else 0
    # replicated across TP without SP: the two norm inputs, the attention and MLP inputs
    # (norm outputs), and the two dropout masks
    replicated = s * b * h * (4 * e + 2 * mask)  # = 10 sbh at e=2 with masks, as in the paper
    # split by TP: Q, K, V; attention output and its copy as the wo input; MLP hidden tensors
    # (GELU: its input and output; SwiGLU: gate, silu(gate), w_in output and their product);
    # the attention log-sum-exp (fp32, per head and position)
    mlp_hidden = s * b * f * (4 * e if m.mlp == "swiglu" else 2 * e)
    sharded = s * b * h * 5 * e + mlp_hidden + b * m.n_heads * s * 4
    if sp:
        return (replicated + sharded) / tp
    return replicated + sharded / tp


@dataclass
class Estimate:
    layout: Layout
    params: float  # bytes per GPU (worst stage)
    grads: float
    optimizer: float
    activations: float
    params_count: int  # parameters on the worst stage's GPU (before ZeRO-3 sharding)
    pipeline: Optional[dict] = None  # the torch engine's pipeline: schedule, bubble, microbatches in flight

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        return d


def model_state_bytes(n_params: int, layout: Layout, precision: str = "bf16") -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes for ``n_params`` on one GPU under ZeRO ``layout.zero``.

    16-bit runs accumulate gradients in fp32 (``data_types.grad_accum_dtype``, which the trainer
    sets, as Megatron's main_grad): a 16-bit gradient per micro batch plus the fp32 accumulator,
    6 bytes per parameter.
    """
    if layout.engine == "torch":  # FSDP2: fp32 masters, fp32 gradients and Adam state, all sharded
        shard = layout.dp_shard  # (gradients reduce-scattered every micro batch: never held unsharded)
        return n_params * 4 / shard, n_params * 4 / shard, n_params * 8 / shard
    if precision == "fp32":
        pb, gb, ob = 4, 4, 8
    else:
        pb, gb, ob = 2, 2 + 4, 12
    dp, z = layout.dp, layout.zero
    params = n_params * pb / (dp if z >= 3 else 1)
    grads = n_params * gb / (dp if z >= 2 else 1)
    opt = n_params * ob / (dp if z >= 1 else 1)
    return params, grads, opt


def estimate(m, seq: int, layout: Layout, precision: str = "bf16", dropout_masks: bool | None = None) -> Estimate:
    """Memory per GPU on the most loaded pipeline stage."""
    e = 4 if precision == "fp32" else 2
    masks = (m.dropout > 0) if dropout_masks is None else dropout_masks
    if layout.engine == "torch" and layout.pp > 1:
        return _torch_pipeline_estimate(m, seq, layout, precision, masks)
    per_stage = stage_params(m, layout, layout.partition)
    blocks = blocks_per_stage(m, layout, layout.partition)
    t, b, sp = layout.tp, layout.micro_batch, layout.sequence_parallel
    layer = layer_activation_bytes(m, seq, b, t, sp, e, masks)
    stored_input = seq * b * m.d_model * e / (t if sp else 1)
    best = None
    for i, n_params in enumerate(per_stage):
        in_flight = min(layout.pp - i, layout.pp)  # 1F1B: stage i holds pp - i micro batches
        if layout.activation_checkpointing:
            act = in_flight * blocks[i] * stored_input + layer
        else:
            act = in_flight * blocks[i] * layer
        if i == layout.pp - 1:  # final norm input + fp32 logits for the loss
            act += stored_input + seq * b * m.vocab_size * 4 / t
        if i == 0:
            act += in_flight * stored_input  # input codes / embedding output
        p, g, o = model_state_bytes(n_params, layout, precision)
        if layout.engine == "torch" and (layout.dp_shard > 1 or precision != "fp32"):
            # FSDP2's unsharded working parameters in the compute dtype (all-gathered or cast): the
            # block computing plus the one prefetched, and the root's and the head's groups, which
            # stay gathered from forward to backward (native/build.py); or every group
            per_layer = layer_params(m, t)
            edges = per_layer[0] + per_layer[-1]  # the input (table) and the head: root and head groups
            # (one DP rank has no FSDP2: autocast's 16-bit copies of every weight live until backward)
            everything = not layout.reshard_after_forward or layout.dp == 1
            working = n_params if everything else min(n_params, 2 * per_layer[1] + edges)
            p += working * e
        est = Estimate(layout, p, g, o, act, n_params)
        if best is None or est.total > best.total:
            best = est
    return best


def _torch_pipeline_estimate(m, seq: int, layout: Layout, precision: str, masks: bool) -> Estimate:
    """The most loaded pipeline rank of the torch engine (``pipeline_memory``: its split and the
    schedule's microbatches in flight), with the ``pipeline`` summary attached."""
    from ..engine.native.schedules import is_v_shaped, stage_ids, stage_spans
    from .pipeline_memory import pipeline_summary, stage_param_count

    e = 4 if precision == "fp32" else 2
    t, b, sp = layout.tp, layout.micro_batch, layout.sequence_parallel
    layer = layer_activation_bytes(m, seq, b, t, sp, e, masks)
    stored_input = seq * b * m.d_model * e / (t if sp else 1)
    ac = layout.activation_checkpointing
    summary = pipeline_summary(m, layout, stored_input if ac else layer, stored_input, seq * b * m.vocab_size * 4 / t)
    spans = stage_spans(m.n_layers, layout.pp * layout.vpp, layout.edge)
    per_layer = layer_params(m, t)
    best = None
    for r in range(layout.pp):
        mine = [spans[i] for i in stage_ids(r, layout.pp, layout.vpp, is_v_shaped(layout.schedule))]
        n_params = sum(stage_param_count(per_layer, s) for s in mine)
        act = sum(summary["activation_bytes_per_stage"][str(s.index)] for s in mine) + (layer if ac else 0)
        p, g, o = model_state_bytes(n_params, layout, precision)
        if layout.dp_shard > 1 or precision != "fp32":
            p += n_params * e  # every working parameter unsharded (gathered or cast) under PP
        est = Estimate(layout, p, g, o, act, n_params, pipeline=summary)
        if best is None or est.total > best.total:
            best = est
    return best


def feasible_layouts(cfg, gpus: int, max_tp: int = 8, precision: str | None = None) -> list[Layout]:
    """Every (tp, pp, dp, zero, micro, sp) whose run plan builds, for ``gpus`` GPUs in ``precision``
    (None: the config's ``train.precision``, resolved for a GPU)."""
    import copy

    from ..run_plan import RunPlan
    from .layout import LayoutError

    out = []
    torch_engine = getattr(cfg.train, "engine", "deepspeed") == "torch"
    tps = [t for t in (1, 2, 4, 8, 16) if t <= min(gpus, max_tp)]
    for tp in tps:
        for pp in range(1, gpus // tp + 1):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            # DeepSpeed: each ZeRO stage; torch: each HSDP replicate degree (1 = FSDP over all DP, dp = replicate)
            for zero in ([r for r in range(1, dp + 1) if dp % r == 0] if torch_engine else (0, 1, 2, 3)):
                for micro in (1, 2, 4, 8, 16, 32):
                    if micro * dp > cfg.train.global_batch:
                        continue
                    for sp in ((False, True) if tp > 1 else (False,)):
                        c = copy.deepcopy(cfg)
                        c.parallel.tp, c.parallel.pp = tp, pp
                        if torch_engine:
                            c.torch_engine.dp_replicate = zero
                        else:
                            c.zero.stage = zero
                        c.parallel.sequence_parallel, c.train.micro_batch = sp, micro
                        c.train.precision = precision or c.train.precision
                        c.parallel.backend = "auto"  # GPU memory is what is sized, whatever the config's backend
                        try:
                            RunPlan.build(c, gpus, gpu=True)
                        except LayoutError:
                            continue
                        # Both balancing rules under PP: with fixed codes, balancing parameters
                        # moves blocks onto stage 0, which holds the most in-flight micro batches.
                        for part in (("parameters", "type:Block") if pp > 1 and not torch_engine
                                     else ("parameters",)):
                            if torch_engine:  # "zero" shows the ZeRO stage FSDP2's sharding equals
                                accum = cfg.train.global_batch // (micro * dp)
                                par = cfg.parallel
                                out.append(Layout(tp, pp, dp, 3 if dp // zero > 1 else 0, micro, sp,
                                                  cfg.train.activation_checkpointing, part, "torch", zero, accum,
                                                  cfg.torch_engine.reshard_after_forward, par.pp_schedule,
                                                  par.vpp, par.pp_input_head_layers))
                            else:
                                out.append(Layout(tp, pp, dp, zero, micro, sp, cfg.train.activation_checkpointing,
                                                  part))
    return out


def fixed_code_saving(m, layout: Layout, precision: str = "bf16") -> dict:
    """What the fixed codes save versus a learned table of the same shape, on the first stage's GPU."""
    n = m.vocab_size * m.d_model // layout.tp
    p, g, o = model_state_bytes(n, layout, precision)
    return {"params": n, "param_bytes": p, "grad_bytes": g, "optimizer_bytes": o, "total_bytes": p + g + o}
