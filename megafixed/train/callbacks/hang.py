"""The hang watchdog as a callback (``watchdog.timeout_s``; the watchdog itself is ``train/watchdog.py``):
started before the first step, a step's computation timed and its allowance set, the time between steps
(validation, the record, a save) under the longer allowance of a slow phase, stopped with the run."""
from __future__ import annotations

from .base import Callback


class HangWatch(Callback):
    name = "watchdog"

    def __init__(self, section, collective_timeout_s: float):
        self.section, self.collective_timeout_s, self.dog = section, collective_timeout_s, None

    def setup(self, run) -> None:
        from ..watchdog import HangWatchdog

        self.run = run
        self.dog = HangWatchdog.for_run(self.section.timeout_s, self.collective_timeout_s, run.topo,
                                        run.checkpointer.run_dir.faults_dir, run.say, done=run.done)

    def on_start(self) -> None:
        self.dog.start()  # the first step's allowance counts from here

    def before_step(self, step: int) -> None:
        self.dog.pace()  # a full timeout for this step, after the slow phase between steps

    def before_compute(self, step: int) -> None:
        self.dog.enter(step)
        self._t0 = _now()

    def after_compute(self, step: int) -> None:
        self.dog.finish(step, _now() - self._t0)

    def after_step(self, step: int) -> None:
        if self.run.result is None:
            self.dog.touch(step)  # progress without a timed step (a skipped step's batches consumed)
        self.dog.slow_phase()  # validation, the record and a save: at least parallel.collective_timeout_s

    def on_stop(self, step: int) -> None:
        self.dog.stop()

    def on_error(self, exc: BaseException) -> None:
        if self.dog is not None:
            self.dog.stop()


def _now() -> float:
    import time

    return time.perf_counter()


def build(section, cfg) -> HangWatch:
    return HangWatch(section, cfg.parallel.collective_timeout_s)
