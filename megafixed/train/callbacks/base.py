"""The callback seam of the training loop: ``Callback`` (one concern of a run, every hook a no-op
by default) and ``RunContext`` (what a callback is handed at ``setup``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass
class RunContext:
    """The run a callback belongs to: the whole Config, this process's Topology, the Engine, the run
    directory; ``say`` prints on rank 0 only; ``log_metrics(step, values)`` writes one metrics record
    ``{"step": step, **values}`` to every sink on rank 0 (a no-op elsewhere; every rank may call it)."""

    cfg: Any
    topo: Any
    engine: Any
    run_dir: Path
    say: Callable[[str], None]
    log_metrics: Callable[[int, dict], None]


class Callback:
    """One concern of a run. Every hook is a no-op by default; a callback overrides what it needs."""

    name: str = ""  # unique in a run; the key of its state in the checkpoint

    def setup(self, run: RunContext) -> None:  # once, after the engine is built and the checkpoint resumed
        pass

    def on_start(self) -> None:  # before the first step of this process (after setup)
        pass

    def before_step(self, step: int) -> None:
        pass

    def judge_step(self, step: int, loss: float, grad_norm: float):  # None = good
        return None

    def after_step(self, step: int) -> None:  # after the update of `step` (step 1 = first update)
        pass

    def on_record(self, step: int, record: dict) -> None:  # every metrics record, before it is written
        pass

    def before_save(self, step: int) -> None:
        pass

    def after_save(self, step: int, tag: str) -> None:
        pass

    def on_stop(self, step: int) -> None:  # the loop ended normally (max_steps or a stop request)
        pass

    def on_error(self, exc: BaseException) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
