"""A test's pause point between steps (``megafixed/pause.py``, ``MEGAFIXED_PAUSE=train.step@N``): before step
N begins, after step N-1's metrics and checkpoint are written. Unset, it costs one ``is None`` per step."""
from __future__ import annotations

from ... import pause as pauses
from .base import Callback


class PausePoint(Callback):
    name = "pause"

    pause = None

    def preflight(self, topo, resume, say) -> None:
        self.pause = pauses.armed("train.step", rank=topo.rank)  # None: no pause here (one test per step)

    def before_step(self, step: int) -> None:
        if self.pause is not None:  # before step: the metrics and checkpoint of the one before are written
            self.pause.reached(step)


def build(section, cfg) -> PausePoint:
    return PausePoint()
