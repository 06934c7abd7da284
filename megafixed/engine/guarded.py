"""The bad-step guard and the injected loss faults, as any engine's step asks them (engine-agnostic).

The trainer attaches ``engine.guard`` (``megafixed.run.bad_steps.BadStepGuard``) and ``engine.faults``
(``megafixed.run.faults.FaultPlan`` or None). An engine used without the trainer (a benchmark) has
neither: a non-finite loss then follows ``train.on_nonfinite`` as it always did, and nothing else is
judged. Steps here are the loop's 0-based counter; verdicts carry the log's numbering (+1).
"""
from __future__ import annotations

from typing import Optional

from .base import NonFiniteLossError, nonfinite_message


def scaled_loss(loss, faults, step: int):
    """``loss`` times this rank's injected factor for the step (NaN for ``nan@``), else ``loss``."""
    if faults is None:
        return loss
    factor = faults.loss_factor(step + 1)
    return loss if factor is None else loss * factor


def loss_verdict(guard, step: int, value: float, nonfinite: bool, on_nonfinite: str):
    """The verdict on the step's global-batch loss (already all-reduced: identical on every rank)."""
    if guard is not None:
        return guard.judge(step + 1, "loss", float("nan") if nonfinite else value)
    if not nonfinite:
        return None
    if on_nonfinite == "stop":
        raise NonFiniteLossError(nonfinite_message(step, value))
    from ..run.bad_steps import Verdict

    return Verdict(step + 1, "nonfinite", "loss", value, on_nonfinite)


def norm_verdict(guard, step: int, norm: Optional[float]):
    """The verdict on the global gradient norm the update would clip with (identical on every rank)."""
    return guard.judge(step + 1, "grad_norm", norm) if guard is not None else None
