"""The drills of ``faults.inject`` (``run/faults.py``: the grammar and the faults themselves) as a callback: a
drill that cannot fire in this run is refused before anything is touched; an injected exit or hang comes
before a computation of its step; a loss fault multiplies each micro batch's loss on its way to the
backward; the ``slow`` drill spins inside each timed forward (the stragglers callback times it). A drill
is recorded in every checkpoint's run record, and a requeue of a run written under the same drill goes on
with it (its earlier faults have had their turn)."""
from __future__ import annotations

from typing import Optional

from ...run.faults import KEY, FaultPlan, InjectError, parse
from .base import Callback


class Drills(Callback):
    name = "faults"

    def __init__(self, inject: str, max_steps: int):
        parse(inject)  # a malformed drill is one line before anything is built or touched
        self.inject, self.max_steps = inject, max_steps
        self.say = print

    def preflight(self, topo, resume, say) -> None:
        self.plan = FaultPlan.from_config(self.inject, topo.rank)  # this rank's share of the drill
        refusal = self.plan.refusal(topo.world_size, self.max_steps, self._done(resume))
        if refusal:
            raise InjectError(refusal)

    def _done(self, resume) -> int:
        """The steps a drill can no longer reach: those the resumed checkpoint has done -- unless it was
        written under the same drill (a requeue of it goes on: its earlier faults have had their turn)."""
        if resume is None:
            return 0
        from ...run.run_dir import tag_step
        from ...run.run_record import read_run_record

        same = (read_run_record(resume.tag_dir) or {}).get("fault_injection") == self.inject
        return 0 if same else tag_step(resume.tag)

    def setup(self, run) -> None:
        self.say = run.say
        run.checkpointer.note(fault_injection=self.inject)
        if self.plan.slow:
            run.slow_forward = self.plan.slow_down

    def on_start(self) -> None:
        self.say(f"fault injection: {'; '.join(f.spelled() for f in self.plan.every_rank)} ({KEY})")

    def before_compute(self, step: int) -> None:
        self.plan.before_step(step)  # an injected exit or hang happens here: this rank never enters the step

    def micro_loss(self, step: int, loss):
        factor = self.plan.loss_factor(step)
        return loss if factor is None else loss * factor


def build(section, cfg) -> Optional[Drills]:
    if not (section.inject and section.inject.strip()):
        return None
    return Drills(section.inject, cfg.train.max_steps)
