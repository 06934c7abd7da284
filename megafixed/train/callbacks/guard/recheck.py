"""Computing a bad step again, to tell a transient fault from a deterministic one (Megatron core's
``--rerun-mode validate_results``): on a verdict every rank recomputes the step from the state before
its update -- the same micro batches, the same RNG -- and only the recomputation's verdict counts.

What a step keeps for it while ``guard.recheck`` is on (the guard callback, ``__init__.py``) is host-side
bookkeeping, with no device read and no collective: the RNG states before the step (torch's CPU
generator and this rank's CUDA one, the only ones a step draws from: a few KiB copied, ``StepReplay``),
references to the micro batches as the engine pulls them, and each micro batch's loss on its way to the
backward, detached and left on the device (the guard callback's ``micro_loss``). The state before the
update needs no copy: an engine drops the update of a step its guard gave a verdict on, leaving weights,
gradients and optimizer state bit-identical (tested on both engines), so recomputing is restoring the
RNG and replaying the kept micro batches through ``engine.train_step``.

Which rank: each rank compares its own micro-batch losses of the two computations bit for bit, and
one gather (after a verdict only) tells every rank who differed, with its node (``differing``). Under
data parallelism that is the rank whose computation went wrong. Every rank of a tensor-parallel group
holds the same loss, so the group is named together; under pipeline parallelism only the last stage
holds losses, so a fault upstream is named on the last stage's ranks (the ones whose values differed).
A fault that changed only the gradients, no loss, names no rank.
"""
from __future__ import annotations

import os
import socket
from typing import Iterator

import torch
import torch.distributed as dist


def node_name() -> str:
    """This rank's node as Slurm names it (what ``sbatch --exclude`` takes), else its host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class StepReplay:
    """One step's starting point for a recomputation: the RNG states before it and, as the engine pulls
    them through this iterator, its micro batches."""

    def __init__(self, batches: Iterator):
        from ...checkpoint import rng_state

        self.rng, self.source, self.taken = rng_state(torch_only=True), batches, []

    def __iter__(self) -> "StepReplay":
        return self

    def __next__(self):
        batch = next(self.source)
        self.taken.append(batch)
        return batch

    def again(self) -> Iterator:
        """The RNG as it was before the step, and the same micro batches in the same order."""
        from ...checkpoint import set_rng_state

        set_rng_state(self.rng)
        return iter(self.taken)


def _bits(losses: list) -> bytes:
    if not losses:
        return b""
    plain = [t.to_local() if hasattr(t, "to_local") else t for t in losses]  # a TP loss is a replicated DTensor
    return torch.stack([t.reshape(()).double() for t in plain]).cpu().numpy().tobytes()  # exact for any float dtype


def differing(first: list, again: list, world: int) -> list[dict]:
    """On every rank (a collective when ``world > 1``): ``{"rank", "node", "differed"}`` of every rank,
    ``differed`` None on a rank that held no loss (a pipeline stage before the last)."""
    mine = {"node": node_name(), "differed": (_bits(first) != _bits(again)) if first or again else None}
    if world > 1 and dist.is_initialized():
        out: list = [None] * world
        dist.all_gather_object(out, mine)
    else:
        out = [mine]
    return [{"rank": r, **rec} for r, rec in enumerate(out)]
