"""The bad-step guard as one callback (``guard.*``; ``data.skip_steps``): the verdict on each step's reduced
loss and global gradient norm before its update (``verdict.py``: non-finite or a spike over the
window of good steps), the re-check of a verdict, what a verdict does, and the steps whose data is skipped.

* A good step enters the guard's windows (its state, in every checkpoint).
* A verdict is checked once by computing the step again from the same state (``guard.recheck``; the RNG
  and the micro batches kept by ``recheck.StepReplay``, each micro batch's loss noted on its way to the
  backward): good again is a transient fault, trained on the recomputation, counted per node; bad again is
  acted on as ``guard.on_nonfinite`` / ``guard.on_spike`` say -- ``stop`` raises, ``skip`` was the engine's
  (the update dropped), ``rollback`` reloads the newest verified checkpoint before the step
  (``rollback.py``) and skips the data up to the bad step plus ``guard.rollback_skip``.
* The steps to skip: ``data.skip_steps`` and the windows of earlier rollbacks (``skip.py``, kept in
  the run directory so that a resume skips the same data).

Every verdict is one line, a ``metrics.jsonl`` row (``{"step", "bad_step": ...}``; a transient one
``{"step", "transient_fault": ...}``) and a line of ``<run_dir>/faults/bad_steps.jsonl``, which is
written before the line that points at it and is never truncated (a resume truncates ``metrics.jsonl``
past its checkpoint). ``guard.max_transient_faults`` on one node make the run save and exit
``exit_codes.EXCLUDE_NODE`` with the node in ``<run_dir>/faults/exclude_nodes.txt``, which the Slurm job
script resubmits without.

Every decision is made from values every rank holds identically (the reduced loss and norm, one gather of
who differed), so every rank decides the same without a collective of its own.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

from ....engine.base import StepResult
from ....launch.world import ranges
from ....step_ranges import spelled
from ..base import Callback, Rewind
from .recheck import StepReplay, differing
from .skip import SkipSteps
from .verdict import BadStepGuard

BAD_STEPS_FILE = "bad_steps.jsonl"  # under <run_dir>/faults/
EXCLUDE_FILE = "exclude_nodes.txt"  # under <run_dir>/faults/: one node a line, read by the Slurm job script


class BadSteps(Callback):
    name = "bad_steps"

    def __init__(self, section, skip_steps, max_steps: int):
        self.section, self.configured_skips, self.max_steps = section, list(skip_steps), max_steps
        self.guard = BadStepGuard.from_config(section)
        self.recheck = bool(section.recheck)
        self.leaving: list[str] = []  # nodes past guard.max_transient_faults: the run saves and exits
        self.seen: list = []  # this rank's micro-batch losses of the step's computation (the re-check's notes)
        self._kept: Optional[StepReplay] = None

    def setup(self, run) -> None:
        self.run, self.topo, self.say = run, run.topo, run.say
        self.faults_dir = run.checkpointer.run_dir.faults_dir
        self.file = self.faults_dir / BAD_STEPS_FILE
        self.skips = SkipSteps(self.configured_skips, self.faults_dir)  # data.skip_steps and the rollbacks' windows

    def on_start(self) -> None:
        if self.skips:
            self.say(f"skipping the batches of steps {spelled(self.skips.ranges)} (data.skip_steps"
                     + (f" and rollbacks recorded in {self.skips.file}" if self.skips.rolled_back else "") + ")")

    # ---- what a checkpoint keeps
    def state_dict(self) -> dict:
        return self.guard.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.guard.load_state_dict(state)

    # ---- around a step
    def skips_step(self, step: int) -> bool:
        return step in self.skips

    def before_step(self, step: int) -> None:
        self.seen = []

    def step_batches(self, step: int, batches):
        """The iterator the step pulls its micro batches from: with the re-check on, one that keeps them
        (and the RNG states before the step) for a recomputation."""
        if not self.recheck:
            return batches
        self._kept = StepReplay(batches)
        return self._kept

    def micro_loss(self, step: int, loss):
        if self.recheck:
            self.seen.append(loss.detach())
        return loss

    def judge_step(self, step: int, loss: Optional[float], grad_norm: Optional[float]):
        if grad_norm is None:
            return self.guard.judge(step, "loss", loss)
        return self.guard.judge(step, "grad_norm", grad_norm)

    def settle_step(self, step: int, result: StepResult, again: Callable[..., StepResult]):
        """``result`` of step ``step`` judged: the result to log (the recomputation's, for a transient
        fault), or ``Rewind``. ``again(batches)`` computes the step once more."""
        if result.verdict is None:  # the one test a good step pays
            if not result.skipped:
                self.guard.accept(result.loss, result.grad_norm)
            return result
        if not self.recheck:
            return self._act(step, result, {})
        first, self.seen = self.seen, []
        redo = again(self._kept.again())
        who = differing(first, self.seen, self.topo.world_size)
        named = [w for w in who if w["differed"]]
        if redo.verdict is not None:  # it repeats: the data or the model, not the device
            return self._act(step, redo, {"recheck": "repeated", "first": result.verdict.record()})
        self.guard.accept(redo.loss, redo.grad_norm)
        self._transient(step, result.verdict, redo, named)
        return redo

    def after_step(self, step: int) -> None:
        if self.leaving and step < self.max_steps:  # (a finished run has nothing to move)
            self.run.leaving = list(self.leaving)

    def on_stop(self, step: int) -> None:
        if self.run.leaving:
            ckpt = self.run.checkpointer
            self.say(self._leave_line(ckpt.ckpt_dir / ckpt.latest))

    # ---- a verdict acted on
    def _act(self, step: int, result: StepResult, extra: dict):
        verdict = result.verdict
        record = {**verdict.record(), **extra}
        line = verdict.line(self.guard.sigma, self.guard.size,
                            again=" again, computed a second time from the same state (not transient)" if extra else "")
        self._write(record)
        self.say(f"{line}; recorded in {self.file}")
        self.run.note({"step": step, "bad_step": record})
        if verdict.action == "stop":
            from ....engine.base import NonFiniteLossError, nonfinite_message
            from .rollback import BadStepError

            if verdict.kind == "nonfinite" and verdict.what == "loss":
                raise NonFiniteLossError(nonfinite_message(step, verdict.value))
            raise BadStepError(f"{line}. The run stops here; the last checkpoint is intact. Set {verdict.key()}=skip "
                               f"or =rollback to go on past such steps")
        if verdict.action == "skip":  # the engine dropped the update; the batch counts as consumed
            return result
        from .rollback import roll_back

        run = self.run
        client = roll_back(run.checkpointer, run.engine, verdict, self.skips, self.section, self.topo, self.say)
        run.rewind(int(client["step"]))  # the records past the checkpoint go, as on a resume from it
        run.note({"step": step, "bad_step": record})  # again after the rewind, which truncated it
        return Rewind(int(client["step"]), int(client["consumed_samples"]), client)

    def _transient(self, step: int, verdict, redo: StepResult, named: list) -> None:
        """A verdict the recomputation did not repeat: recorded, counted per node, maybe the node left."""
        nodes = sorted({w["node"] for w in named})
        counts = self._counts()  # before this one (rank 0 read them; every rank gets them)
        for node in nodes:
            counts[node] = counts.get(node, 0) + 1
        record = {**verdict.record(), "action": "recomputed", "recheck": "transient",
                  "ranks": [w["rank"] for w in named], "nodes": nodes,
                  "recomputed": {"loss": redo.loss, "grad_norm": redo.grad_norm}}
        self._write(record)
        self.run.note({"step": step, "transient_fault": record})
        where = (f"rank{'s' if len(named) > 1 else ''} {ranges([w['rank'] for w in named])} on {', '.join(nodes)}"
                 if named else "no rank's loss differed (a fault in the gradients: the rank is not known)")
        limit = self.section.max_transient_faults
        tally = ", ".join(f"{counts[n]} on {n}" for n in nodes)
        self.say(f"transient fault at step {step}: {verdict.why(self.guard.sigma, self.guard.size)} on the first "
                 f"computation, good when computed again from the same state (loss {redo.loss:.6g}): {where}. Trained "
                 f"on the recomputation, nothing skipped; recorded in {self.file}"
                 + (f" ({tally} in this run; guard.max_transient_faults={limit})" if nodes else ""))
        over = [n for n in nodes if limit > 0 and counts[n] >= limit]
        if over:
            self.leaving = over
            self._write_exclude(over)

    def _counts(self) -> dict:
        """Transient faults per node so far in this run (``faults/bad_steps.jsonl``, read by rank 0)."""
        counts: dict = {}
        if self.topo.is_main and self.file.exists():
            for line in self.file.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill
                if rec.get("recheck") == "transient":
                    for node in rec.get("nodes", []):
                        counts[node] = counts.get(node, 0) + 1
        return _from_rank0(counts, self.topo.world_size)

    def _write(self, record: dict) -> None:
        if self.topo.is_main:
            self.faults_dir.mkdir(parents=True, exist_ok=True)
            with open(self.file, "a") as f:
                f.write(json.dumps(record) + "\n")

    def _write_exclude(self, nodes: list) -> None:
        if not self.topo.is_main:
            return
        path = self.faults_dir / EXCLUDE_FILE
        old = path.read_text().split() if path.exists() else []
        from ....atomic import atomic_write_text

        atomic_write_text(path, "".join(f"{n}\n" for n in sorted(set(old) | set(nodes))))

    def _leave_line(self, checkpoint: Optional[Path]) -> str:
        limit = self.section.max_transient_faults
        return (f"leaving node{'s' if len(self.leaving) > 1 else ''} {', '.join(self.leaving)}: "
                f"{limit} transient faults there (guard.max_transient_faults={limit}; {self.file}); checkpoint "
                f"{checkpoint} is complete. Exit 77: the Slurm job resubmits itself without "
                f"{'them' if len(self.leaving) > 1 else 'it'} ({self.faults_dir / EXCLUDE_FILE}); elsewhere, run the "
                f"same command on other nodes")


def _from_rank0(obj, world: int):
    import torch.distributed as dist

    if world > 1 and dist.is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def build(section, cfg) -> BadSteps:
    return BadSteps(section, cfg.data.skip_steps, cfg.train.max_steps)
