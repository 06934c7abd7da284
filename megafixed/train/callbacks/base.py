"""What a callback is, and what the loop hands it (OLMo-core's ``Callback`` is the shape).

A run is the loop (``train/trainer.py``: resume, step, save) and a list of callbacks, each one concern
with its own state and its own config section: the drills, validation, the evidence of a failed run, the
hang watchdog, stragglers, the bad-step guard, W&B, the metrics log, a user's own. The loop names none of
them; it calls every callback's hooks in the order of the list (``callbacks/__init__.py``).

Hooks, in the order a step meets them (``step``: numbered as in the logs, step 1 is the first update):

* ``preflight(topo, resume, say)`` -- once the resume point is known (None: a fresh start), before anything in
  the run directory is touched; raise to refuse the run;
* ``setup(run)`` -- once, after the engine is built and the checkpoint resumed (then ``load_state_dict``
  with the callback's state from that checkpoint, if it has one);
* ``on_start()`` -- before the first step of this process;
* ``before_step(step)``; ``skips_step(step)`` -- True: the step's data is consumed without training;
  ``step_batches(step, batches)`` -- the iterator the step pulls its micro batches from (e.g. one that keeps
  them for a recomputation);
* ``before_compute(step)`` / ``after_compute(step)`` -- around each computation of the step (a re-check
  computes it again), on every rank;
* ``micro_loss(step, loss)`` -- every micro batch's loss on its way to its backward;
  ``judge_step(step, loss, grad_norm)`` -- a verdict on the reduced loss (``grad_norm`` None) or the global
  gradient norm (``loss`` None) before the update, None when good; the engine drops the update of a judged
  step;
* ``settle_step(step, result, again)`` -- the step's result acted on (``again(batches)`` computes it once
  more): the result to go on with, or a ``Rewind`` to a checkpoint;
* ``after_step(step)`` -- after the update (``run.result``: the step's ``StepResult``, None when its data was
  skipped); ``on_record(step, record)`` -- every step's metrics record, on every rank, before rank 0
  writes it: a callback may add fields;
* ``before_save(step)`` / ``after_save(step, tag)``; ``on_stop(step)`` -- the loop ended normally;
  ``on_error(exc)`` -- the run failed (also before ``setup``, when the failure came first);
* ``state_dict()`` / ``load_state_dict(state)`` -- kept in every checkpoint's client state
  (``"callbacks": {name: state}``) and restored on resume and on a rollback.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional


class Callback:
    """One concern of a run. Every hook is a no-op by default; a callback overrides what it needs."""
    name: str = ""  # unique in a run; the key of its state in the checkpoint (client state "callbacks": {name: state})

    def preflight(self, topo, resume, say) -> None: ...
    def setup(self, run: "RunContext") -> None: ...
    def on_start(self) -> None: ...
    def before_step(self, step: int) -> None: ...

    def skips_step(self, step: int) -> bool:
        return False

    def step_batches(self, step: int, batches):
        return batches

    def before_compute(self, step: int) -> None: ...
    def after_compute(self, step: int) -> None: ...

    def micro_loss(self, step: int, loss):
        return loss

    def judge_step(self, step: int, loss: Optional[float], grad_norm: Optional[float]):
        return None

    def settle_step(self, step: int, result, again: Callable):
        return result

    def after_step(self, step: int) -> None: ...
    def on_record(self, step: int, record: dict) -> None: ...
    def before_save(self, step: int) -> None: ...
    def after_save(self, step: int, tag: str) -> None: ...
    def on_stop(self, step: int) -> None: ...
    def on_error(self, exc: BaseException) -> None: ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class Rewind:
    """A callback took the run back to a checkpoint (a rollback): the loop goes on after its step, from its
    data position, with the callbacks' state from its client state."""
    step: int
    consumed_samples: int
    client: dict


@dataclass
class RunContext:
    """What the loop hands every callback at ``setup``; the fields below the line change as the run goes."""
    cfg: Any  # the whole Config
    topo: Any  # the Topology: rank, world_size, dp_rank, dp, tp, pp, is_main, plan
    engine: Any  # the Engine
    run_dir: Path
    say: Callable[[str], None]  # prints on rank 0 only
    checkpointer: Any  # the run's Checkpointer (train/checkpoint.py)
    stop: Any  # the StopRequest
    callbacks: list  # every callback of the run, in hook order
    datasets: dict
    resume_step: int  # the steps done when this process started
    # ---- what the run has done so far
    done: int = 0  # steps done
    consumed: int = 0  # samples consumed
    lr: float = 0.0  # the learning rate of the step in flight
    result: Any = None  # the last step's StepResult (None: its data was skipped)
    last_val_loss: Optional[float] = None
    leaving: list = field(default_factory=list)  # nodes the run must leave: it saves and exits 77
    halt: bool = False  # end the loop before another step (a stop during the step-0 validation)
    record_now: bool = False  # a callback wants this step's metrics record written (a validation)
    slow_forward: Optional[Callable[[float], None]] = None  # the ``slow`` drill: given each timed forward's seconds
    history: list = field(default_factory=list)  # every record logged (rank 0's are the run's)
    writer: Any = None  # what log_metrics writes to on rank 0 (metrics.jsonl, TensorBoard and the sinks)
    sinks: list = field(default_factory=list)  # more writers of the same records (W&B)

    def log_metrics(self, step: int, values: dict) -> None:
        """One metrics record ``{"step": step, **values}`` to ``metrics.jsonl``, TensorBoard and W&B (rank 0;
        on the other ranks a no-op). Every rank may call it."""
        self.write({"step": step, **values})

    def write(self, record: dict) -> None:
        """A record as it is, kept in the run's history."""
        if self.writer is not None:
            self.writer.write(record)
        self.history.append(record)

    def note(self, record: dict) -> None:
        """A row of ``metrics.jsonl`` that is not a step's record (a bad step's verdict): not in the history."""
        if self.writer is not None:
            self.writer.write(record)

    def rewind(self, step: int) -> None:
        """Back to after ``step`` (a rollback): the records past it go, from the history and the files."""
        self.history[:] = [r for r in self.history if r.get("step", 0) <= step]
        if self.writer is not None:
            self.writer.rewind(step)
