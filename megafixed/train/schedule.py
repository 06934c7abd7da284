"""Learning-rate schedules as pure functions of the optimizer step.

The trainer sets the learning rate from ``lr_at(step)`` before every optimizer step instead of
relying on a stateful torch scheduler: the whole schedule state is then the step counter, which
the checkpoint already carries, so a resumed run gets exactly the same learning rates.
We write these few lines ourselves because the formulas differ slightly between frameworks
(Megatron's WSD, NeoX's cosine floor) and we want one documented definition.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import OptimizerConfig, ScheduleConfig


@dataclass(frozen=True)
class LRSchedule:
    """Warmup, then one of: cosine to ``min_lr``, WSD (warmup-stable-decay), constant, linear.

    ``step`` counts optimizer steps already taken (0 for the first update). Warmup is linear from
    ``lr / warmup_steps`` up to ``lr`` so that the first update is never taken at lr=0.
    """

    kind: str
    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    wsd_decay_fraction: float = 0.2

    @classmethod
    def from_config(cls, sched: ScheduleConfig, opt: OptimizerConfig, max_steps: int) -> "LRSchedule":
        return cls(kind=sched.kind, lr=opt.lr, min_lr=opt.min_lr, warmup_steps=sched.warmup_steps,
                   decay_steps=sched.decay_steps if sched.decay_steps is not None else max_steps,
                   wsd_decay_fraction=sched.wsd_decay_fraction)

    def lr_at(self, step: int) -> float:
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        total = max(1, self.decay_steps - self.warmup_steps)
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / total))
        if self.kind == "cosine":
            return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))
        if self.kind == "linear":
            return self.lr + (self.min_lr - self.lr) * progress
        if self.kind == "wsd":
            # Stable at lr, then a linear decay to min_lr over the last `wsd_decay_fraction` of steps.
            decay_start = 1.0 - self.wsd_decay_fraction
            if progress <= decay_start or self.wsd_decay_fraction <= 0:
                return self.lr
            frac = (progress - decay_start) / self.wsd_decay_fraction
            return self.lr + (self.min_lr - self.lr) * frac
        raise ValueError(f"unknown schedule.kind {self.kind!r}; use cosine, wsd, constant or linear")

    def state_dict(self) -> dict:
        return {"kind": self.kind, "lr": self.lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps, "wsd_decay_fraction": self.wsd_decay_fraction}
