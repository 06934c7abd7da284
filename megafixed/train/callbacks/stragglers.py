"""The straggler report as a callback (``stragglers.factor``; the clock and the report are
``train/stragglers.py``): each rank's forwards timed while a step computes, and at every metrics record the
gathered per-rank figures added to it (a collective on every rank), a straggler named in one line."""
from __future__ import annotations

from .base import Callback


class StragglerWatch(Callback):
    name = "stragglers"

    def __init__(self, section):
        self.section = section

    def setup(self, run) -> None:
        from ..stragglers import Stragglers

        self.report = Stragglers(run.engine, run.topo, factor=self.section.factor,
                                 faults_dir=run.checkpointer.run_dir.faults_dir, say=run.say, slow=run.slow_forward)

    def before_compute(self, step: int) -> None:
        self._timing = self.report.timing()
        self._timing.__enter__()

    def after_compute(self, step: int) -> None:
        self._timing.__exit__(None, None, None)

    def on_record(self, step: int, record: dict) -> None:
        record.update(self.report.fields(step))


def build(section, cfg) -> StragglerWatch:
    return StragglerWatch(section)
