"""The pipeline bubble of a schedule, read from the schedule's own action table.

``torch.distributed.pipelining`` schedules carry their plan as ``pipeline_order``: per rank, the
ordered list of actions (``F``orward, full ``B``ackward, backward-``I``nput, backward-``W``eight,
``OVERLAP_F_B``, and bookkeeping such as ``REDUCE_GRAD``) over (stage, microbatch). The library
builds that table for placeholder stages (``_schedule_visualizer.get_schedule_ops``: a mock
``PipelineStage``, no process group), so a login node can plan a GPU run's pipeline.

``simulate`` replays the table with unit costs -- F = I = W = 1 and a full B = I + W = 2 (the zero
bubble paper's equal-cost model), no communication time -- each rank running its actions in order,
each action waiting for the one it depends on (F after the previous stage's F of its microbatch,
B/I after the next stage's B/I, or after its own F on the last stage, W after its I). The bubble
fraction is the idle time of a rank over its busy time; beside it ``formula`` gives the closed
forms: GPipe and 1F1B (p-1)/m, looped/interleaved (p-1)/(v*m) (Megatron's interleaved schedule).

Why a replay of our own: the library has the table but no timing model (its visualizer only
spaces the actions); the replay is a dozen lines over that table.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

# unit costs of the action kinds (the rest -- REDUCE_GRAD, UNSHARD, RESHARD, sends and receives -- cost 0)
COSTS = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}


@dataclass(frozen=True)
class Bubble:
    schedule: str
    pp: int
    microbatches: int
    vpp: int
    fraction: float  # idle / busy, from the action table
    formula: float  # the closed form, for comparison (None-free: see ``formula``)
    in_flight: list  # per rank: the most (stage, microbatch) activation sets held at once
    in_flight_per_stage: dict  # stage -> the most microbatches whose activations it holds at once
    # stage -> (microbatches held at its first backward, the most held at a later one): the first comes
    # before any gradient exists (a step's gradients are dropped at its end), the later ones beside them
    held_at_backward: dict = None

    def as_dict(self) -> dict:
        return {"schedule": self.schedule, "pp": self.pp, "microbatches": self.microbatches, "vpp": self.vpp,
                "bubble_fraction": round(self.fraction, 6), "bubble_formula": round(self.formula, 6),
                "in_flight_per_rank": self.in_flight,
                "in_flight_per_stage": {str(k): v for k, v in sorted(self.in_flight_per_stage.items())},
                "held_at_backward": {str(k): list(v) for k, v in sorted((self.held_at_backward or {}).items())}}


def action_table(schedule: str, pp: int, microbatches: int, vpp: int = 1) -> list[list]:
    """Per rank, the schedule's ordered actions (``_Action``; Nones dropped), for placeholder stages."""
    import warnings

    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ops = get_schedule_ops(schedule, pp, microbatches, vpp)
    return _renumbered([[a for a in rank if a is not None] for rank in ops], microbatches)


def _renumbered(table: list[list], m: int) -> list[list]:
    """Repair a table whose microbatch numbers do not run 0..m-1 for some (stage, kind).

    torch 2.13's ``Schedule1F1B._get_pipeline_order`` numbers the last rank's forwards from 1 (its
    warm-up counter starts at 0 and is incremented before the first steady-state forward), listing
    microbatches 1..m; its runtime (``_step_microbatches``) does not read the table. The order of the
    actions is right, so the numbers are reassigned in that order."""
    from collections import defaultdict

    seen = defaultdict(list)
    for actions in table:
        for a in actions:
            if a.microbatch_index is not None:
                seen[(a.stage_index, str(a.computation_type))].append(a.microbatch_index)
    broken = {key for key, ids in seen.items() if sorted(ids) != list(range(m))}
    if not broken:
        return table
    counters: dict = defaultdict(int)
    out = []
    for actions in table:
        row = []
        for a in actions:
            key = (a.stage_index, str(a.computation_type))
            if key in broken:
                a = a._replace(microbatch_index=counters[key])
                counters[key] += 1
            row.append(a)
        out.append(row)
    return out


def _kind(action) -> str:
    return str(action.computation_type.value if hasattr(action.computation_type, "value") else action.computation_type)


def _leaves(action) -> list:
    subs = getattr(action, "sub_actions", None)
    return list(subs) if subs else [action]


def _needs(a, kind: str, last_stage: int) -> list[list[tuple]]:
    """What ``a`` waits for: groups of (stage, kind, microbatch), each met when any one of it has run."""
    s, i = a.stage_index, a.microbatch_index
    if kind == "F":
        return [[(s - 1, "F", i)]] if s > 0 else []
    if kind in ("B", "I"):  # the next stage's B, or its I where it splits the backward
        return [[(s, "F", i)]] if s == last_stage else [[(s + 1, "B", i), (s + 1, "I", i)]]
    if kind == "W":
        return [[(s, "I", i)]]
    return []


def simulate(table: list[list]) -> tuple[float, list[float]]:
    """(makespan, busy time per rank) of ``table`` under ``COSTS``, each rank in its own order."""
    last = max(leaf.stage_index for row in table for a in row for leaf in _leaves(a))
    done: dict = {}  # (stage, kind, microbatch) -> end time
    clock, busy, pos = [0.0] * len(table), [0.0] * len(table), [0] * len(table)
    while any(p < len(row) for p, row in zip(pos, table)):
        progressed = False
        for r, row in enumerate(table):
            while pos[r] < len(row):
                timed = [(leaf, _kind(leaf)) for leaf in _leaves(row[pos[r]]) if _kind(leaf) in COSTS]
                groups = [g for leaf, k in timed for g in _needs(leaf, k, last)]
                met = [[done[d] for d in g if d in done] for g in groups]
                if not all(met):
                    break
                start = max([clock[r], *(min(times) for times in met)])
                cost = sum(COSTS[k] for _, k in timed)
                for leaf, k in timed:
                    done[(leaf.stage_index, k, leaf.microbatch_index)] = start + cost
                clock[r], busy[r] = start + cost if timed else clock[r], busy[r] + cost
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule's action table does not progress (a dependency never runs)")
    return max(clock), busy


def in_flight(table: list[list]) -> tuple[list[int], dict]:
    """Per rank, the most (stage, microbatch) activation sets held at once (held from F until B, or
    until W under a zero-bubble split); per stage, the most microbatches held at once."""
    per_rank, per_stage = [], {}
    for row in table:
        held: dict = {}
        peak = 0
        for a in row:
            for leaf in _leaves(a):
                k, s = _kind(leaf), leaf.stage_index
                if k == "F":
                    held[s] = held.get(s, 0) + 1
                elif k in ("B", "W"):
                    held[s] = held.get(s, 0) - 1
                peak = max(peak, sum(held.values()))
                per_stage[s] = max(per_stage.get(s, 0), held.get(s, 0))
        per_rank.append(peak)
    return per_rank, per_stage


def held_at_backward(table: list[list]) -> dict:
    """Per stage, (the microbatches it holds at its first backward, the most it holds at a later
    backward): GPipe's last stage holds every microbatch at its first backward and one fewer after;
    1F1B's holds one at each. Held from F until B (or W, under a zero-bubble split), as ``in_flight``."""
    out: dict = {}
    for row in table:
        held: dict = {}
        for a in row:
            for leaf in _leaves(a):
                k, s = _kind(leaf), leaf.stage_index
                if k in ("B", "I"):  # a backward starts: what the stage holds now
                    first, later = out.get(s, (None, 0))
                    out[s] = (held.get(s, 0), 0) if first is None else (first, max(later, held.get(s, 0)))
                if k == "F":
                    held[s] = held.get(s, 0) + 1
                elif k in ("B", "W"):
                    held[s] = held.get(s, 0) - 1
    return out


def formula(schedule: str, pp: int, microbatches: int, vpp: int = 1) -> float:
    """The textbook bubble: (p-1)/m, divided by the stages per rank v for looped schedules. For the
    zero-bubble and V schedules the same (p-1)/(v*m) is shown as what interleaving alone would give."""
    return (pp - 1) / (vpp * microbatches)


@functools.lru_cache(maxsize=256)  # the planner asks for the same schedule once per layout row
def bubble(schedule: str, pp: int, microbatches: int, vpp: int = 1) -> Bubble:
    """The schedule's bubble fraction (replayed from its action table) beside the formula."""
    table = action_table(schedule, pp, microbatches, vpp)
    makespan, busy = simulate(table)
    work = max(busy)
    ranks, stages = in_flight(table)
    return Bubble(schedule, pp, microbatches, vpp, (makespan - work) / work, formula(schedule, pp, microbatches, vpp),
                  ranks, stages, held_at_backward(table))
