"""The torch engine's pipeline plan: which schedule, which stages, which blocks -- arithmetic only.

``parallel.pp_schedule`` is any name ``torch.distributed.pipelining.get_schedule_class`` accepts
(GPipe and 1F1B run one stage per rank; Interleaved1F1B, LoopedBFS and InterleavedZeroBubble run
``parallel.vpp`` >= 2 looped stages per rank, rank r holding stages r, r+p, r+2p, ...;
ZBVZeroBubble and DualPipeV run exactly 2 stages per rank in a V, rank r holding r and 2p-1-r).
A step's microbatches are the plan's micro batches (``accum`` of them per data-parallel rank).

``check_pipeline`` refuses, by name and before any process group exists (so in ``--dry-run`` and
``megafixed plan`` too), every constraint of the schedule: the name, the stages per rank, the
microbatch count (it instantiates the schedule class on placeholder stages, so whatever the
library itself would reject at the first step is rejected here), compile with a zero-bubble V
schedule, and blocks that cannot be spread evenly over the stages.

The split: the layer list ``[input] + blocks + [head]`` with the input and the head each counted
as ``parallel.pp_input_head_layers`` layers (default 1: they cost about a block each at small
vocabularies; 0 counts blocks only), cut into ``pp * vpp`` equal runs. Stage k holds the blocks
whose slots fall in its run, under their global names (``blocks.N``), so a checkpoint does not
depend on the split.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...config import ConfigError
from ...parallel.layout import LayoutError

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # the V-shaped stage-to-rank mapping, 2 stages per rank
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")  # split backward (input, weight)


@dataclass(frozen=True)
class StageSpan:
    """One pipeline stage: blocks ``first`` .. ``end - 1``, and whether it holds the input / the head."""
    index: int
    first: int
    end: int
    has_input: bool
    has_head: bool

    @property
    def blocks(self) -> range:
        return range(self.first, self.end)


def schedule_class(name: str):
    """The library's schedule class for ``parallel.pp_schedule`` (ConfigError listing the names)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    try:
        return get_schedule_class(name)
    except ValueError:
        names = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                 "DualPipeV"]
        raise ConfigError(f"parallel.pp_schedule={name!r} is not a torch.distributed.pipelining schedule; use one "
                          f"of {', '.join(names)}") from None


def canonical_name(name: str) -> str:
    return schedule_class(name).__name__.removeprefix("Schedule")


def is_multi_stage(name: str) -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    return issubclass(schedule_class(name), PipelineScheduleMulti)


def is_v_shaped(name: str) -> bool:
    return canonical_name(name) in V_SCHEDULES


def forward_only_schedule(name: str) -> str:
    """The schedule class a forward-only pass of any microbatch count runs over ``name``'s stages.

    A schedule fixes its microbatch count at construction and some refuse counts (1F1B fewer than
    its stages, DualPipeV fewer than twice, the interleaved ones counts their rounds do not
    divide); GPipe, LoopedBFS and ZBVZeroBubble take any, on one stage per rank, looped stages and
    a V respectively -- the same stage-to-rank map as ``name``'s. Forward only, the order in which
    microbatches pass does not change any of their outputs."""
    if is_v_shaped(name):
        return "ZBVZeroBubble"
    return "LoopedBFS" if is_multi_stage(name) else "GPipe"


def stage_spans(n_layers: int, stages: int, edge: int = 1) -> list[StageSpan]:
    """The blocks of each of ``stages`` stages (see the module docstring); LayoutError if uneven."""
    slots = n_layers + 2 * edge
    if slots % stages:
        raise LayoutError(f"model.n_layers={n_layers} blocks plus the input and the head (each counted as "
                          f"parallel.pp_input_head_layers={edge} layers) make {slots} layers, which do not divide "
                          f"into {stages} pipeline stages (parallel.pp x parallel.vpp); change model.n_layers, "
                          f"parallel.pp, parallel.vpp or parallel.pp_input_head_layers")
    per = slots // stages
    spans = []
    for k in range(stages):
        lo, hi = k * per, (k + 1) * per  # slots [lo, hi); block b sits at slot edge + b
        first, end = min(max(lo - edge, 0), n_layers), min(max(hi - edge, 0), n_layers)
        spans.append(StageSpan(k, first, end, has_input=k == 0, has_head=k == stages - 1))
    return spans


def stage_ids(pp_rank: int, pp: int, vpp: int, v_shaped: bool) -> list[int]:
    """The stages rank ``pp_rank`` runs, in order (torch's ``generate_stage_to_rank_mapping`` styles)."""
    if v_shaped:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(vpp)]


class _Placeholder:
    """What a schedule's constructor reads of its stages (the library's visualizer mocks the same)."""

    def __init__(self, num_stages: int, group_size: int, index: int):
        self.num_stages, self.group_size, self.group_rank, self.stage_index = num_stages, group_size, 0, index
        self.submod = None
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stage_index_to_group_rank = {}


def _constructor_refusal(name: str, pp: int, vpp: int, microbatches: int):
    """The library's own ValueError for this schedule, pp, vpp and microbatch count, or None."""
    import warnings

    cls = schedule_class(name)
    stages = [_Placeholder(pp * vpp, pp, k) for k in range(vpp)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls(stages if is_multi_stage(name) else stages[0], microbatches)
    except ValueError as exc:
        return str(exc).replace("\\\n", "").replace("\n", " ")
    return None


def check_pipeline(cfg, plan) -> None:
    """Every refusal of the torch engine's pipeline, one line each (``plan.pp > 1``)."""
    p, vpp, m = plan.pp, plan.engine_plan.vpp, plan.batch.accum
    name = canonical_name(plan.engine_plan.pp_schedule)
    multi = is_multi_stage(name)
    if not multi and vpp != 1:
        raise LayoutError(f"parallel.pp_schedule={name} runs one stage per rank, but parallel.vpp={vpp}; set "
                          f"parallel.vpp=1, or use a looped schedule (Interleaved1F1B, LoopedBFS, "
                          f"InterleavedZeroBubble) for several stages per rank")
    if name in V_SCHEDULES and vpp != 2:
        raise LayoutError(f"parallel.pp_schedule={name} needs exactly 2 stages per rank (a V), but "
                          f"parallel.vpp={vpp}; set parallel.vpp=2")
    if multi and vpp < 2:
        raise LayoutError(f"parallel.pp_schedule={name} runs several stages per rank; set parallel.vpp >= 2 "
                          f"(parallel.vpp={vpp}), or use 1F1B or GPipe for one stage per rank")
    if name in ("1F1B", "DualPipeV") and m < p * (vpp if name == "DualPipeV" else 1):
        need = p * (vpp if name == "DualPipeV" else 1)
        raise LayoutError(f"parallel.pp_schedule={name} needs at least {need} microbatches per step (one per "
                          f"stage), but the plan has {m} (train.global_batch / (train.micro_batch x dp)); raise "
                          f"train.global_batch or lower train.micro_batch")
    if name in ZERO_BUBBLE[1:] and cfg.train.compile:
        raise ConfigError(f"parallel.pp_schedule={name} splits each backward into input and weight parts, which "
                          f"torch.compile'd blocks do not support; set train.compile=false or another schedule")
    why = _constructor_refusal(name, p, vpp, m)
    if why:
        raise LayoutError(f"parallel.pp_schedule={name} with parallel.pp={p}, parallel.vpp={vpp} and {m} "
                          f"microbatches per step: {why}")
    stage_spans(cfg.model.n_layers, p * vpp, plan.engine_plan.pp_input_head_layers)
