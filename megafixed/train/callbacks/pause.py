"""A test's pause point between steps (``megafixed/pause.py``, ``MEGAFIXED_PAUSE=train.step@N``): before step
N begins, after step N-1's metrics and checkpoint are written. Off (no callback) when it is not set."""
from __future__ import annotations

from typing import Optional

from ... import pause as pauses
from .base import Callback


class PausePoint(Callback):
    name = "pause"

    def __init__(self, pause):
        self.pause = pause

    def before_step(self, step: int) -> None:
        self.pause.reached(step)


def build(section, cfg, topo) -> Optional[PausePoint]:
    pause = pauses.armed("train.step", rank=topo.rank)
    return PausePoint(pause) if pause is not None else None
