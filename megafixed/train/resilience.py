"""The trainer's faults-and-recovery component: one object the loop asks around each step.

* before a step: a step in ``data.skip_steps`` or a rollback window has its batches consumed without
  training (``skip_step``); the hang watchdog is told the step began; injected ``exit``/``hang``
  faults happen (``megafixed.run.faults``);
* the engine's step asks ``engine.guard`` (``megafixed.run.bad_steps``) for a verdict on the loss and
  the gradient norm before its update, and ``engine.faults`` for an injected loss factor;
* after a step (``after_step``): a verdict is reported (one line, a ``metrics.jsonl`` row, a line of
  ``<run_dir>/faults/bad_steps.jsonl``) and acted on -- ``stop`` raises, ``skip`` was the engine's,
  ``rollback`` reloads (``rollback.py``) and returns the checkpoint's client state; a good step
  enters the guard's windows;
* at each log interval (``log_extra``) the ranks' step times are gathered and stragglers named.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Optional

from ..run.bad_steps import BadStepGuard
from ..run.faults import ENV, FaultPlan
from ..run.skip_steps import SkipSteps, spelled
from .rollback import BadStepError, roll_back
from .stragglers import ForwardClock, StragglerReport
from .watchdog import HangWatchdog

BAD_STEPS_FILE = "bad_steps.jsonl"  # under <run_dir>/faults/


class Resilience:
    def __init__(self, train, topo, engine, checkpointer, say, *, skip_steps=(), slow_phase_s: float = 600):
        """``train``: the config's train section; ``skip_steps``: ``data.skip_steps``; ``slow_phase_s``:
        ``parallel.collective_timeout_s`` (what the watchdog allows a save or the first step)."""
        from ..launch import rendezvous

        self.train, self.topo, self.engine, self.checkpointer, self.say = train, topo, engine, checkpointer, say
        self.faults_dir = checkpointer.run_dir.faults_dir
        self.plan = FaultPlan.from_env(topo.rank)
        self.guard = BadStepGuard.from_config(train)
        self.skips = SkipSteps(list(skip_steps), self.faults_dir)
        hosts = [p["host"] for p in sorted(rendezvous.peers(), key=lambda p: p["rank"])]
        hosts = hosts if len(hosts) == topo.world_size else None
        self.watchdog = HangWatchdog.for_run(train.hang_timeout_s, slow_phase_s, topo, self.faults_dir, say)
        slow = self.plan.slow_down if self.plan is not None and self.plan.slow else None
        self.clock = ForwardClock(engine.module, engine.device, on_forward=slow)
        self.stragglers = StragglerReport(factor=train.straggler_factor, world=topo.world_size,
                                          device=engine.device, hosts=hosts)
        engine.guard, engine.faults = self.guard, self.plan  # what the engine's step asks
        if self.plan is not None:  # every checkpoint's run record says a drill was running
            checkpointer.record["fault_injection"] = os.environ.get(ENV)
        if self.skips:
            say(f"skipping the batches of steps {spelled(self.skips.ranges)} (data.skip_steps"
                + (f" and rollbacks recorded in {self.skips.file}" if self.skips.rolled_back else "") + ")")
        if self.plan is not None:
            say(f"fault injection: {'; '.join(f.spelled() for f in self.plan.every_rank)} ({ENV})")

    def note_shrink(self, resume) -> Optional[str]:
        """A resume on fewer ranks than the checkpoint's (a requeued job back on fewer nodes, ``submit
        --nodes MIN-MAX``): the data-parallel degree is re-laid out and the global batch kept by
        accumulating more. Said in one line and kept in the run record (``shrunk_from``)."""
        import os

        from ..run.run_record import read_run_record

        nodes = os.environ.get("SLURM_JOB_NUM_NODES")
        if nodes:
            self.checkpointer.record["nodes"] = int(nodes)
        old = read_run_record(resume.tag_dir) if resume is not None else None
        lay = (old or {}).get("layout") or {}
        if not lay or lay.get("tp", 1) * lay.get("pp", 1) * lay.get("dp", 1) <= self.topo.world_size:
            return None
        plan, world = self.topo.plan, lay.get("tp", 1) * lay.get("pp", 1) * lay.get("dp", 1)
        was = {"world": world, "dp": lay.get("dp"), "nodes": (old or {}).get("nodes")}
        self.checkpointer.record["shrunk_from"] = was
        where = f" on {was['nodes']} nodes" if was["nodes"] else ""
        now = f" on {nodes} nodes" if nodes else ""
        line = (f"the job shrank: checkpoint {resume.tag} was written by {world} ranks{where} (dp {lay.get('dp')}), "
                f"this run has {self.topo.world_size}{now} (dp {plan.dp}); the global batch "
                f"{plan.batch.global_batch} is kept by accumulating {plan.batch.accum} micro batches per step")
        self.say(line)
        return line

    def close(self) -> None:
        self.watchdog.stop()

    # ---- around a step
    def skip_step(self, step: int, batches, accum: int) -> bool:
        """Step ``step + 1`` is to be skipped: consume its batches (no forward, no RNG) and say so."""
        if step + 1 not in self.skips:
            return False
        for _ in range(accum):
            next(batches)
        self.watchdog.touch(step + 1)
        return True

    @contextlib.contextmanager
    def step(self, step: int):
        """Around the engine's step of (log) step ``step + 1``."""
        self.watchdog.start()
        if self.plan is not None:
            self.plan.before_step(step + 1)  # an injected hang stops here: this rank never enters the step
        self.watchdog.enter(step + 1)
        self.clock.active, t0 = True, time.perf_counter()
        try:
            yield
        finally:
            self.clock.active = False
        wall = time.perf_counter() - t0
        self.watchdog.finish(step + 1, wall)
        self.stragglers.add_step(wall)

    def grace(self):
        """Around a save or a validation pass (the watchdog allows them longer)."""
        return self.watchdog.grace()

    # ---- after a step
    def after_step(self, step: int, result, metrics) -> Optional[dict]:
        """Act on the verdict of (log) step ``step``; the checkpoint's client state after a rollback."""
        verdict = getattr(result, "verdict", None)
        if verdict is None:
            if not result.skipped:
                self.guard.accept(result.loss, result.grad_norm)
            return None
        self._report(verdict, metrics)
        if verdict.action == "stop":
            from ..engine.base import NonFiniteLossError, nonfinite_message

            if verdict.kind == "nonfinite" and verdict.what == "loss":
                raise NonFiniteLossError(nonfinite_message(step - 1, verdict.value))
            raise BadStepError(f"{self._line(verdict)}. The run stops here; the last checkpoint is intact. Set "
                               f"{verdict.key()}=skip or =rollback to go on past such steps")
        if verdict.action == "skip":
            return None
        with self.watchdog.grace():  # a reload takes as long as a save may
            client = roll_back(self.checkpointer, self.engine, verdict, self.skips, self.train, self.topo, self.say)
        self.guard.load_state_dict(client.get("bad_steps"))
        _rewind(metrics, int(client["step"]))
        metrics.metrics.write({"step": verdict.step, "bad_step": verdict.record()})  # kept past the truncation
        return client

    def _line(self, verdict) -> str:
        return verdict.line(self.guard.sigma, self.guard.size)

    def _report(self, verdict, metrics) -> None:
        self.say(self._line(verdict))
        metrics.metrics.write({"step": verdict.step, "bad_step": verdict.record()})  # the file; not the history
        if self.topo.is_main:
            self.faults_dir.mkdir(parents=True, exist_ok=True)
            with open(self.faults_dir / BAD_STEPS_FILE, "a") as f:
                f.write(json.dumps(verdict.record()) + "\n")

    def state(self) -> dict:
        """What a checkpoint keeps of this component: the guard's windows."""
        return {"bad_steps": self.guard.state_dict()}

    def log_extra(self, step: int) -> dict:
        """At a log interval (every rank: a collective): the per-rank step times, stragglers named."""
        figures = self.stragglers.gather(self.clock.take())
        if figures is None:
            return {}
        line = self.stragglers.line(step, figures)
        if line:
            self.say(line)
        return figures


def _rewind(steps, step: int) -> None:
    """The records (and TensorBoard events) past ``step`` go, as on a resume from that step: the files
    are closed and reopened by the next record, which truncates them first (``MetricsLog._open``)."""
    steps.history[:] = [r for r in steps.history if r.get("step", 0) <= step]
    log = steps.metrics
    if log.fh is not None:
        log.fh.close()
        log.fh = None
    if log.writer is not None:
        log.writer.close()
        log.writer = None
    log.resume_step = step
