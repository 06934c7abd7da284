"""Memory per GPU of a (TP, PP, DP, ZeRO, micro-batch) layout, before launching anything.

Model states (per parameter; ZeRO paper, Rajbhandari et al. 2020):

=============  ======  =====  ==========================================
precision      params  grads  optimizer state
=============  ======  =====  ==========================================
bf16 / fp16    2       2+4    12 (fp32 master copy + Adam m and v)
fp32           4       4      8 (Adam m and v; the params are the master)
=============  ======  =====  ==========================================

ZeRO-1 divides the optimizer state by DP, ZeRO-2 also the gradients, ZeRO-3 also the parameters.
DeepSpeed's engine (``engine/deepspeed/planner.py``) departs from the table where it measured
otherwise: an fp32 master partition under ZeRO in fp32 too, only the fp32 gradient partition at
ZeRO 2-3, and its own buffers (the reduction bucket, ZeRO-3's gathered and persistent parameters)
plus a second peak, the gradient reduction, against the loss backward (``Estimate.tensors``).

``train.engine=torch`` (FSDP2) shards all three over the DP shard degree (``dp / dp_replicate``;
HSDP replicates across ``dp_replicate`` groups), as ZeRO-3, but keeps different bytes: the sharded
parameters are the fp32 masters (4), gradients are reduce-scattered in fp32 (4), Adam m and v (8) --
16 per parameter in bf16 and fp32 alike, against DeepSpeed bf16's 20. On top, the unsharded working
copies in the compute dtype: two blocks' (the one computing and the one prefetched) plus the
input's and the head's (gathered from forward to backward) with ``torch_engine.reshard_after_forward=
true``, the whole stage's with false or under pipeline parallelism. Gradient accumulation adds
nothing: FSDP2 reduce-scatters every micro batch's gradients into the sharded fp32 ones (as
torchtitan does), instead of holding the unsharded fp32 gradients between reductions.

An engine's planner may size its own pipeline (``pipeline_estimate``): the torch engine's
(``engine/native/pipeline_plan.py``) splits the layers as its stages do and reads the microbatches
each stage holds in flight from the schedule's own action table (``engine/native/bubble.py``), with the
bubble fraction beside it.

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
that PP does not shrink activation memory). The last stage adds the loss's working set
(``loss_phase_bytes``: three fp32 logit-sized tensors, ``12*s*b*V/t``, in its backward).

Context parallelism (``layout.cp``): every activation term is of the rank's ``s/cp`` positions
(``context_parallel_seq`` says why Ulysses' full-sequence tensors on a head slice count the same), and
the model states shard over data x context ranks (``Layout.dp_shard``, ``Layout.dp_cp``).

Where the peak sits: a step's gradients are dropped at its end (``zero_grad(set_to_none=True)``), so
with one micro batch per step (accum 1) none exists at the loss backward, where the activations
peak; they appear as each group's backward reduces it, while the activations are freed. The row is
then the larger of the loss backward without gradients and the backward's end with all of them
(``Estimate.grads_in_backward`` / ``reduction``, the engine planner's ``reduction_phase``). From the
second micro batch on, every gradient (or FSDP2's partial sum of it) is held through the backward.

The estimates are checked against measured tensor bytes on CPU in ``tests/test_parallel_plan.py``,
DeepSpeed's whole step peak against its real 2-rank step in ``tests/test_deepspeed_memory.py``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

GiB = 1024 ** 3

# What no tensor count sees, fake or real on CPU, and every GPU job pays: the CUDA context with
# cuBLAS/cuDNN workspaces (about 0.5-1 GiB), NCCL's communicator buffers (about 0.5-1 GiB over a
# few communicators), and the caching allocator's fragmentation. A fixed, stated allowance, not a
# measurement: ``megafixed plan`` adds it to every row's total (its own column, ``reserve`` in --json).
RESERVE_BYTES = 3 * GiB


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
    engine: str = ""  # train.engine ("": the default engine); its planner does its model-state arithmetic
    dp_replicate: int = 1  # HSDP's replicate degree (torch_engine.dp_replicate; 1 for ZeRO)
    accum: int = 1  # micro batches per step (a pipeline's microbatches)
    reshard_after_forward: bool = True  # torch_engine.reshard_after_forward
    schedule: str = "1F1B"  # parallel.pp_schedule (the torch engine's; DeepSpeed runs 1F1B)
    vpp: int = 1  # parallel.vpp: pipeline stages per rank
    edge: int = 1  # parallel.pp_input_head_layers
    reduce_bucket: int = 500_000_000  # zero.reduce_bucket_size: DeepSpeed's gradient bucket, in elements
    float8: str = "off"  # train.float8 (torch engine): tensorwise all-gathers the blocks' weights in float8
    cp: int = 1  # parallel.cp: ranks each sequence is split over (context parallelism)
    cp_method: str = "ulysses"  # parallel.cp_method: ulysses (all-to-all) | ring (key/value passes)

    @property
    def dp_cp(self) -> int:
        """The ranks a step's gradients are reduced over: data x context parallel (each context-parallel
        rank computed the gradient of other tokens of the same sequences)."""
        return self.dp * self.cp

    @property
    def dp_shard(self) -> int:
        """The degree the model states are sharded over (FSDP2's shard dim, which folds cp in as
        torchtitan's ``dp_shard_cp`` does; ZeRO's dp, times cp)."""
        return self.dp_cp // self.dp_replicate
    @property
    def planner(self):
        """Its engine's planner (``EngineKind.planner``: its sharding arithmetic and table column)."""
        from ..engines import engine_kind

        return engine_kind(self.engine).planner


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


_SIZES: dict[tuple, list] = {}


def layer_param_sizes(m, tp: int = 1) -> list[list[int]]:
    """Each parameter's element count on one TP rank, per pipeline layer (input, blocks..., head):
    what an engine that treats small tensors apart needs (ZeRO-3 keeps those whole, ``engine/
    deepspeed/planner.py``). From the meta model and the ``sharded_dim`` rule, as ``tp_param_counts``."""
    from ..model.gpt import meta_gpt
    from .tensor import sharded_dim

    key = (repr(m), tp)
    if key not in _SIZES:
        model = meta_gpt(m)
        layers: list[list[int]] = [[] for _ in range(m.n_layers + 2)]
        for name, p in {id(p): (name, p) for name, p in model.named_parameters()}.values():
            at = 0 if name.startswith("input.") else m.n_layers + 1 if name.startswith("head.") \
                else int(name.split(".")[1]) + 1
            layers[at].append(p.numel() // (tp if sharded_dim(name) is not None else 1))
        _SIZES[key] = layers
    return _SIZES[key]


_BOUNDS: dict[tuple, list] = {}


def stage_bounds(m, layout: Layout, partition: str = "parameters") -> list[int]:
    """Layer boundaries of the pipeline stages, computed by DeepSpeed's own partitioner with the
    same weights ``PipelineModule`` uses (so the plan matches the real split). Cached: the plan asks
    for the same split for every row of one (TP, PP) (its memory and its traffic), and DeepSpeed's
    balanced partitioner takes tens of milliseconds a call."""
    key = (repr(m), layout.tp, layout.pp, partition, layout.engine)
    if key not in _BOUNDS:
        _BOUNDS[key] = _stage_bounds(m, layout, partition)
    return list(_BOUNDS[key])


def _stage_bounds(m, layout: Layout, partition: str) -> list[int]:
    engine_stage_bounds = layout.planner.stage_bounds  # the layout's engine's partitioner (DeepSpeed's)
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
    # replicated across TP without SP: the two norms' saved inputs, the attention and MLP inputs
    # (norm outputs), and the two dropout masks. RMSNorm computes in fp32: with 16-bit activations
    # each keeps two fp32 copies of its input (the upcast and the normalised product; measured
    # under ``plan --fake``, 23.6 GiB against 18.6 for the paper's bf16 inputs at 1.7B without AC)
    norm_saved = 8 if (m.norm == "rmsnorm" and e < 4) else e
    replicated = s * b * h * (2 * norm_saved + 2 * e + 2 * mask)  # the paper's 10 sbh: 2+2+2+2+2
    # split by TP: Q, K, V; attention output and its copy as the wo input; MLP hidden tensors
    # (GELU: its input and output; SwiGLU: gate, silu(gate), w_in output and their product);
    # the attention log-sum-exp (fp32, per head and position)
    mlp_hidden = s * b * f * (4 * e if m.mlp == "swiglu" else 2 * e)
    sharded = s * b * h * 5 * e + mlp_hidden + b * m.n_heads * s * 4
    if sp:
        return (replicated + sharded) / tp
    return replicated + sharded / tp


def loss_phase_bytes(m, seq: int, micro: int, tp: int, sp: bool) -> float:
    """What the loss's backward holds at once, on one TP rank (measured under ``plan --fake``).

    ``cross_entropy_loss`` upcasts the logits to fp32 and ``F.cross_entropy`` is log_softmax then
    nll_loss: its backward holds three fp32 logit-sized tensors together -- the saved log-probs,
    nll_loss's (dense) gradient and log_softmax's gradient -- 12 bytes per logit element, where the
    paper's 4 counts the logits alone. The final norm keeps two fp32 copies of its input (RMSNorm
    computes in fp32). The vocabulary-parallel loss (TP: DTensor's ``loss_parallel``) holds a
    fourth, of its local shard (measured: 3.0 GiB at 1.7B, TP2, micro batch 4)."""
    logits = seq * micro * m.vocab_size / tp
    norm = 2 * seq * micro * m.d_model * 4 / (tp if sp else 1)
    return (4 if tp > 1 else 3) * 4 * logits + norm


def loss_saved_bytes(m, seq: int, micro: int, tp: int, act_bytes: int = 2) -> float:
    """What one microbatch's loss keeps from its forward to its backward, on one TP rank: the fp32
    log-probs ``F.cross_entropy`` saves and the logits themselves, which a pipeline stage keeps as
    its output for the backward. A last stage that runs several forwards before their backwards
    (GPipe) holds this per microbatch in flight (measured under ``plan --fake``: 1.7B PP2 GPipe, micro
    batch 8, 4.9 GiB more than one microbatch's loss on the last stage)."""
    return seq * micro * m.vocab_size / tp * (4 + act_bytes)


@dataclass
class Estimate:
    layout: Layout
    params: float  # bytes per GPU (worst stage)
    grads: float
    optimizer: float
    activations: float
    params_count: int  # parameters on the worst stage's GPU (before ZeRO-3 sharding)
    pipeline: Optional[dict] = None  # an engine's own pipeline summary (schedule, bubble, in flight)
    reserve: float = RESERVE_BYTES  # CUDA context, NCCL buffers, fragmentation: fixed, not modelled
    # An engine that reduces its gradients through copies of its own (DeepSpeed) has two peaks: the
    # loss backward, holding the activations and only the gradient buffers it keeps from step to step
    # (``grads_in_backward``; None: all of ``grads``, as FSDP2 and the paper count), and the reduction,
    # after or late in the backward, holding every gradient and its transient copies (``reduction``).
    grads_in_backward: Optional[float] = None
    reduction: float = 0.0

    @property
    def tensors(self) -> float:
        """The tensors' bytes at the step's peak: what ``plan --fake`` and the DeepSpeed check
        (``engine/deepspeed/measure_memory.py``) measure (everything but the reserve)."""
        held = self.grads if self.grads_in_backward is None else self.grads_in_backward
        return self.params + self.optimizer + max(held + self.activations, self.grads + self.reduction)

    @property
    def total(self) -> float:
        return self.tensors + self.reserve

    def as_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        d["tensors"] = self.tensors
        return d


def model_state_bytes(n_params: int, layout: Layout, precision: str = "bf16") -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes for ``n_params`` on one GPU: the layout's engine's arithmetic
    (DeepSpeed's ZeRO stages, ``engine/deepspeed/planner.py``; FSDP2's, ``engine/native/planner.py``)."""
    return layout.planner.model_state_bytes(n_params, layout, precision)


def estimate(m, seq: int, layout: Layout, precision: str = "bf16", dropout_masks: bool | None = None) -> Estimate:
    """Memory per GPU on the most loaded pipeline stage. Under context parallelism every activation
    is of the rank's ``seq / cp`` positions (``context_parallel_seq``)."""
    e = 4 if precision == "fp32" else 2
    seq = context_parallel_seq(seq, layout)
    masks = (m.dropout > 0) if dropout_masks is None else dropout_masks
    own = layout.planner.pipeline_estimate(m, seq, layout, precision, masks) if layout.pp > 1 else None
    if own is not None:  # the engine sizes its own pipeline (its split, its schedule)
        return own
    per_stage = stage_params(m, layout, layout.partition)
    blocks = blocks_per_stage(m, layout, layout.partition)
    t, b, sp = layout.tp, layout.micro_batch, layout.sequence_parallel
    layer = layer_activation_bytes(m, seq, b, t, sp, e, masks)
    stored_input = seq * b * m.d_model * e / (t if sp else 1)
    best = None
    for i, n_params in enumerate(per_stage):
        in_flight = min(layout.pp - i, layout.pp)  # 1F1B: stage i holds pp - i micro batches
        last = loss_phase_bytes(m, seq, b, t, sp) if i == layout.pp - 1 else 0.0
        if layout.activation_checkpointing:
            # the loss backward (every stored input, the loss's working set) comes before the last
            # block's recomputation, whose activations are the other candidate peak
            act = in_flight * blocks[i] * stored_input + max(layer, last)
        else:
            act = in_flight * blocks[i] * layer + last  # the peak: the loss backward, all saved
        if i == layout.pp - 1:  # the final norm's input
            act += stored_input
        if i == 0 and not layout.activation_checkpointing:
            act += in_flight * stored_input  # input codes / embedding output (under AC: block 0's stored input)
        p, g, o = model_state_bytes(n_params, layout, precision)
        p += layout.planner.working_param_bytes(m, layout, n_params, precision, e)  # e.g. FSDP2's gathered copies
        est = Estimate(layout, p, g, o, act, n_params)
        # DeepSpeed's buckets and copies; FSDP2's at accum 1. The last backward's layer: what is live
        # beside the gradients as the backward ends
        buffers, est.grads_in_backward, est.reduction = layout.planner.reduction_phase(m, layout, n_params,
                                                                                       precision, layer)
        est.grads += buffers
        if best is None or est.total > best.total:
            best = est
    return best


def context_parallel_seq(seq: int, layout: Layout) -> int:
    """The positions whose activations one context-parallel rank keeps: ``seq / cp``, for every saved
    tensor of a layer alike. Outside the attention core a rank holds its slice of every sequence; inside
    it, Ulysses' rank holds the whole sequence for ``heads / cp`` heads -- Q, K and V (K and V after the
    GQA repeat, at the query heads), the output and the fp32 log-sum-exp the kernel saves are each
    ``[b, s, heads/cp, hd]`` (``[b, heads/cp, s]``), the bytes of ``[b, s/cp, heads, hd]``; the
    all-to-alls' buffers are transients that save nothing for backward. Ring attention keeps its own
    slice's Q, K, V, output and log-sum-exp, and receives the other slices' keys and values as
    transients. The model drops the s x s score term at every cp as at cp 1 (the flash / memory-efficient
    kernels keep none), so the whole layer is linear in the positions."""
    return seq // layout.cp


def fixed_code_saving(m, layout: Layout, precision: str = "bf16") -> dict:
    """What the fixed codes save versus a learned table of the same shape, on the first stage's GPU."""
    n = m.vocab_size * m.d_model // layout.tp
    p, g, o = model_state_bytes(n, layout, precision)
    return {"params": n, "param_bytes": p, "grad_bytes": g, "optimizer_bytes": o, "total_bytes": p + g + o}
