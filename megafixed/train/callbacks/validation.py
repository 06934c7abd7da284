"""Validation as a callback (``validation.interval``, ``validation.iters``; the pass itself is
``train/validation.py``): at step 0 (the curve's starting point, ~ln vocab), every interval and at the last
step. Its loss goes into that step's metrics record; a stop request during a pass cuts it short (and a stop
during the step-0 pass ends the run before its first step: there is nothing to save yet)."""
from __future__ import annotations

from typing import Optional

from ..validation import Validator
from .base import Callback


class Validation(Callback):
    name = "validation"

    def __init__(self, section, max_steps: int):
        self.section, self.max_steps = section, max_steps
        self.val: Optional[float] = None  # this step's validation loss (None: none at this step)

    def setup(self, run) -> None:
        self.run = run
        self.validator = Validator(run.engine, run.datasets.get("valid"), self.section, self.max_steps, run.topo,
                                   run.stop)

    def on_start(self) -> None:
        run = self.run
        if run.done == 0 and self.validator.should_validate(0):
            val0 = self.validator.run()  # consumes no RNG
            run.halt = val0 is None  # a stop arrived during the pass: nothing to save yet
            if val0 is not None:
                run.write({"step": 0, "val_loss": val0, "consumed_samples": 0})
                run.say(f"step 0/{self.max_steps} | val {val0:.4f}")

    def after_step(self, step: int) -> None:
        self.val = self.validator.run() if self.validator.should_validate(step) else None
        if self.val is not None:
            self.run.last_val_loss = self.val
            self.run.record_now = True

    def on_record(self, step: int, record: dict) -> None:
        if self.val is not None:
            record["val_loss"] = self.val


def build(section, cfg) -> Validation:
    return Validation(section, cfg.train.max_steps)
