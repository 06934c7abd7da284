"""Bytes each rank all-gathers, reduce-scatters and all-reduces per training step, by axis, before
launching anything (``megafixed plan``'s ``comm_bytes``; ``--fake`` measures the same figures).

A collective's bytes are its buffer on one rank (NCCL-tests' "size"): the gathered output of an
all-gather, the unreduced input of a reduce-scatter, the tensor of an all-reduce. What the wire
carries follows from it by the ring factors in ``BUS_FACTOR`` (``(n-1)/n`` per all-gather and
reduce-scatter, twice that per all-reduce), which the step-time bound applies per group size.

Engine-neutral terms are here: tensor parallelism (DTensor's and megatron-core's TP move the same
activations: Megatron's f/g pair per attention and MLP, Korthikanti et al. 2022 section 4.2.2) and
the pipeline's point-to-point activations; the data-parallel terms are the engine's (its planner's
``dp_traffic``: FSDP2's gathers and reduce-scatters, ZeRO's reductions).

Per layer and micro batch, with ``A = s*b*h`` activation elements of ``e`` bytes:

* TP without SP: an all-reduce of ``A`` after each row-parallel Linear (2 forward) and of each
  module's input gradient (2 backward); with SP, each all-reduce becomes a reduce-scatter plus an
  all-gather of the same ``A`` (2 + 2 forward, 2 + 2 backward). Activation checkpointing repeats
  the forward's collectives but the block's last (non-reentrant checkpointing stops recomputing
  once backward has what it saved; measured at 1.7B, TP2). The head adds one more pair (its input gathered / its input
  gradient reduced), and the vocabulary-parallel loss three all-reduces of ``s*b`` fp32 values.
* PP: each stage boundary sends ``A`` forward and receives its gradient backward (``A*e`` each
  way per micro batch). Not checked against a measurement: no engine's PP runs under ``--fake``.
* CP (context parallelism, ``cp_traffic``): every term above is of the rank's ``s/cp`` positions.
  Ulysses adds four all-to-alls per attention layer and micro batch in forward (q, k and v from
  sequence- to head-sharded, the output back), each of its ``[b, s/cp, heads/tp, hd]`` tensor (k and
  v at the key/value heads when they split over cp, else repeated to the query heads first), and
  the same four in backward (their gradients); checkpointing's recompute repeats the forward's. Ring
  attention passes each rank's key/value block ``cp - 1`` times round the ring per layer in forward,
  and again in backward with the blocks' gradients beside them (point-to-point).
"""
from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")


def bus_factor(kind: str, n: int) -> float:
    """Bytes a ring moves over each rank's link per byte of buffer (NCCL-tests' busbw factors)."""
    if n <= 1:
        return 0.0
    # an all-to-all keeps 1/n of its buffer and sends the rest
    return {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n,
            "all_to_all": (n - 1) / n, "p2p": 1.0}[kind]


@dataclass
class Traffic:
    """Bytes per rank per step: ``{(axis, kind): bytes}``, and each axis' group size."""
    bytes: dict = field(default_factory=dict)
    group: dict = field(default_factory=dict)  # axis -> ranks in its group

    def add(self, axis: str, kind: str, nbytes: float, group: int) -> None:
        if nbytes and group > 1:
            self.bytes[(axis, kind)] = self.bytes.get((axis, kind), 0.0) + nbytes
            self.group[axis] = group

    @property
    def total(self) -> float:
        return sum(self.bytes.values())

    def by_kind(self) -> dict:
        out: dict = {}
        for (_, kind), b in self.bytes.items():
            out[kind] = out.get(kind, 0.0) + b
        return out

    def as_dict(self) -> dict:
        return {"total": self.total, "by_kind": self.by_kind(),
                "by_axis": {f"{a}.{k}": b for (a, k), b in sorted(self.bytes.items())}, "groups": dict(self.group)}


def tp_traffic(out: Traffic, m, seq: int, layout, act_bytes: int, blocks: int, last_stage: bool) -> None:
    """Tensor parallelism's activation collectives of one step (``layout.accum`` micro batches)."""
    t = layout.tp
    if t == 1:
        return
    a = seq * layout.micro_batch * m.d_model * act_bytes
    ac = layout.activation_checkpointing
    head = a if last_stage else 0
    n = layout.accum
    # Per layer: 2 forward + 2 backward of each kind (SP) or of all-reduces; checkpointing's
    # recompute repeats the forward's but the block's last (the MLP's row-parallel reduction: no
    # backward needs its output, and non-reentrant checkpointing stops recomputing early).
    if layout.sequence_parallel:
        out.add("tp", "all_gather", n * (blocks * a * (4 + (2 if ac else 0)) + head), t)
        out.add("tp", "reduce_scatter", n * (blocks * a * (4 + (1 if ac else 0)) + head), t)
    else:
        out.add("tp", "all_reduce", n * (blocks * a * (4 + (1 if ac else 0)) + head), t)
    if last_stage:  # loss_parallel: max, sum of exp and the target logit, fp32 per position
        out.add("tp", "all_reduce", n * 3 * seq * layout.micro_batch * 4, t)


def pp_traffic(out: Traffic, m, seq: int, layout, act_bytes: int, stage: int = 1) -> None:
    """This stage's sends and receives per microbatch: the activation forward and its gradient
    backward, each way (a middle stage receives and sends both; the first and the last only one
    of each)."""
    if layout.pp == 1:
        return
    a = seq * layout.micro_batch * m.d_model * act_bytes / (layout.tp if layout.sequence_parallel else 1)
    neighbours = 1 if stage in (0, layout.pp - 1) else 2
    out.add("pp", "p2p", layout.accum * 2 * neighbours * a, layout.pp)


def cp_traffic(out: Traffic, m, seq: int, layout, act_bytes: int, blocks: int) -> None:
    """Context parallelism's collectives of one step (``layout.accum`` micro batches) on the ``cp`` axis,
    for ``seq`` positions per sequence (the whole sequence: each rank holds ``seq / cp`` of them)."""
    cp = layout.cp
    if cp == 1:
        return
    t, b, hd = layout.tp, layout.micro_batch, m.head_dim
    heads, kv = m.n_heads // t, max(m.kv_heads // t, 1)
    local = seq // cp * b * hd * act_bytes  # one head's slice of one tensor on this rank
    passes = layout.accum * blocks
    if layout.cp_method == "ring":
        block = 2 * kv * local  # this rank's K and V
        out.add("cp", "p2p", passes * (cp - 1) * block * 3, cp)  # forward K/V; backward K/V and dK/dV
        return
    kv_sent = kv if kv % cp == 0 else heads  # UlyssesAttention repeats indivisible K/V heads first
    per_pass = (2 * heads + 2 * kv_sent) * local  # q, out; k, v
    forwards = 2 if layout.activation_checkpointing else 1  # the recompute's forward too
    out.add("cp", "all_to_all", passes * per_pass * (forwards + 1), cp)


def _stages(m, layout) -> tuple[list, list]:
    """(parameters, blocks) of each pipeline stage: the engine's partitioner's split, or, for an
    engine without one (the torch engine splits in its own pipeline plan), blocks evenly."""
    from .memory import blocks_per_stage, layer_params, stage_params

    try:
        return stage_params(m, layout, layout.partition), blocks_per_stage(m, layout, layout.partition)
    except NotImplementedError:
        per_layer, pp = layer_params(m, layout.tp), layout.pp
        blocks = [m.n_layers // pp + (1 if i < m.n_layers % pp else 0) for i in range(pp)]
        params = [b * per_layer[1] for b in blocks]
        params[0] += per_layer[0]
        params[-1] += per_layer[-1]
        return params, blocks


def traffic(m, seq: int, layout, precision: str = "bf16") -> Traffic:
    """Bytes per rank per step on the most loaded stage (the one the memory estimate reports)."""
    e = 4 if precision == "fp32" else 2
    per_stage, blocks = _stages(m, layout)
    worst = max(range(layout.pp), key=lambda i: per_stage[i])
    out = Traffic()
    local = seq // layout.cp  # every term but context parallelism's own is of the rank's positions
    tp_traffic(out, m, local, layout, e, blocks[worst], worst == layout.pp - 1)
    pp_traffic(out, m, local, layout, e, worst)
    cp_traffic(out, m, seq, layout, e, blocks[worst])
    layout.planner.dp_traffic(out, m, layout, per_stage[worst], blocks[worst], precision)
    return out
