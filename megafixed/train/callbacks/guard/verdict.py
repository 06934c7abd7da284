"""The bad-step guard's policy: one verdict for a non-finite value or a spike, over the loss and the gradient
norm of a step, taken before that step's update (Megatron core's NaN check and
``--check-for-spiky-loss``, OLMo-core's ``SkipStepOptimizer``).

* non-finite: the global-batch loss or the global gradient norm is NaN/Inf;
* spike: the value is beyond ``guard.spike_sigma`` standard deviations above the mean of the last
  ``guard.spike_window`` accepted steps (one-sided: a loss that falls faster is no fault). No verdict
  before the window is full, so warm-up's steep first steps are never judged.

``guard.on_nonfinite`` / ``guard.on_spike`` say what a verdict does: ``stop``, ``skip`` (the update is
dropped, the batch counted as consumed) or ``rollback`` (the trainer reloads the newest verified
checkpoint and skips the data up to the bad step; ``rollback.py``). What a verdict does is the callback's
(``__init__.py``); the engines see only ``engine.base.StepVerdict``, what every verdict here is.

WHY EVERY RANK AGREES without a collective of its own: the guard only ever sees values that are
already identical on every rank -- the loss after the engine's data-parallel all-reduce (one rank's
NaN makes the reduced non-finite flag of every rank true) and the global gradient norm the engine
clips with (reduced over the whole mesh). Every rank runs the same arithmetic on the same numbers
over the same window (its contents travel in the checkpoint), so every rank reaches the same verdict.

WHY NO HOST SYNC IS ADDED on a GPU: both values already cross to the host once per step in the
engines (the loss in ``engine.batches.dp_mean_and_flag``, the one read of its stacked
[loss, non-finite] tensor; the norm where the engine clips and logs it). The guard judges those host
copies: it adds arithmetic on a 128-float window, no device read and no collective.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Optional

from ....engine.base import StepVerdict


@dataclass
class Verdict(StepVerdict):
    """The engine's ``StepVerdict`` (step, kind, what, value, action) with the spike's window and the words."""
    mean: Optional[float] = None  # the window's, for a spike
    std: Optional[float] = None

    def why(self, sigma: float, window: int) -> str:
        if self.kind == "nonfinite":
            return f"the {self.what.replace('_', ' ')} is {self.value} (non-finite)"
        return (f"the {self.what.replace('_', ' ')} {self.value:.6g} is a spike: beyond {sigma:g} sigma of the "
                f"last {window} steps (mean {self.mean:.6g}, std {self.std:.3g})")

    def line(self, sigma: float, window: int, again: str = "") -> str:
        """``again``: words after the reason (the re-check's finding)."""
        why = self.why(sigma, window)
        return f"bad step {self.step}: {why}{again}; action {self.action} ({self.key()}={self.action})"

    def key(self) -> str:
        return "guard.on_nonfinite" if self.kind == "nonfinite" else "guard.on_spike"

    def record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


class Window:
    """The last ``size`` accepted values of one quantity, with their mean and (population) std."""

    def __init__(self, size: int, values=()):
        self.values: deque = deque(values, maxlen=size)

    @property
    def full(self) -> bool:
        return len(self.values) == self.values.maxlen

    def stats(self) -> tuple[float, float]:
        n = len(self.values)
        mean = math.fsum(self.values) / n
        return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in self.values) / n)


class BadStepGuard:
    """Judges each step's loss and gradient norm; ``accept`` adds a good step to the windows. No defaults:
    the ``guard`` section's (``GuardConfig``, through ``from_config``) are the only ones."""

    def __init__(self, *, sigma: float, window: int, on_nonfinite: str, on_spike: str):
        self.sigma, self.size = float(sigma), int(window)
        self.on_nonfinite, self.on_spike = on_nonfinite, on_spike
        self.windows = {"loss": Window(self.size), "grad_norm": Window(self.size)}

    @classmethod
    def from_config(cls, section) -> "BadStepGuard":
        """From the ``guard`` section (``GuardConfig``)."""
        return cls(sigma=section.spike_sigma, window=section.spike_window, on_nonfinite=section.on_nonfinite,
                   on_spike=section.on_spike)

    def judge(self, step: int, what: str, value: Optional[float]) -> Optional[Verdict]:
        """The verdict on ``value`` (the loss or the grad norm of log step ``step``), or None if good."""
        if value is None:  # an engine that reports no norm for this step
            return None
        if not math.isfinite(value):
            return Verdict(step, "nonfinite", what, value, self.on_nonfinite)
        window = self.windows[what]
        if not window.full:
            return None
        mean, std = window.stats()
        if value > mean + self.sigma * std:
            return Verdict(step, "spike", what, value, self.on_spike, mean, std)
        return None

    def accept(self, loss: Optional[float], grad_norm: Optional[float]) -> None:
        for what, value in (("loss", loss), ("grad_norm", grad_norm)):
            if value is not None and math.isfinite(value):
                self.windows[what].values.append(float(value))

    def state_dict(self) -> dict:
        return {what: list(w.values) for what, w in self.windows.items()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the windows a checkpoint kept (``state_dict``'s)."""
        for what in self.windows:
            self.windows[what] = Window(self.size, state[what])
