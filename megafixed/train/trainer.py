"""``train(cfg, topo)``: the training loop of one rank, on any number of nodes. It resumes, steps, saves
and calls its callbacks' hooks; it names no concern of its own. The engine (``megafixed.engine``: model,
optimizer, the step, its checkpoint files), the checkpointer (``checkpoint.py``: the commit protocol, the
resume check with its fall-back past a damaged checkpoint, its cadence) and the stop request (``stop.py``)
are the loop's; everything else is a callback with its own state and config section
(``callbacks/``: the drills, validation, the evidence of a failed run, the hang watchdog, stragglers, the
bad-step guard with its re-check, rollback and skipped data, W&B, the metrics log and progress lines,
and the user's own). Steps are numbered as in the logs everywhere: step 1 is the first update, and after
it ``done == 1``.

Reproducibility contract (CPU, fp32): the same command twice, or a run killed and started again,
logs bit-identical losses. What makes that true: every parameter's initial value is a function
of (seed, name); the data position is the number of consumed samples (the sample order is a pure
function of the seed); the learning rate is a pure function of the step; checkpoints carry the
optimizer moments, every rank's python/numpy/torch RNG state and every callback's state.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..atomic import atomic_write_text
from ..config import Config, save_config
from ..engine import build_engine, engine_config
from ..run import plan_choice
from ..run.run_dir import RunDirectory, tag_step
from ..run.run_lock import hold_run_dir
from ..threads import apply_thread_policy
from .callbacks import CallbackHooks, build_callbacks
from .callbacks.base import Callback, Rewind, RunContext
from .checkpoint import Checkpointer, RunIdentity
from .resume import shrink_note
from .schedule import LRSchedule
from .stop import StopRequest


@dataclass
class TrainResult:
    run_dir: str
    step: int  # optimizer steps completed
    consumed_samples: int
    resumed_from: Optional[str]  # checkpoint tag we started from, if any
    last_loss: Optional[float]
    last_val_loss: Optional[float]
    checkpoint: Optional[str]  # tag of the newest checkpoint
    stopped: bool = False  # a stop request ended the run early (after saving)
    history: list = field(default_factory=list)  # every logged record (rank 0)
    leaving: list = field(default_factory=list)  # nodes with guard.max_transient_faults (saved; exit 77)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def train(cfg: Config, topo, *, datasets: Optional[dict] = None, stop: Optional[StopRequest] = None,
          log: Callable[[str], None] = print, callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Train (or resume) the run described by ``cfg`` on this rank of ``topo``, as the run
    directory's only writer (``run_lock``: a second trainer is refused before it reads anything).
    ``callbacks``: the user's own, after the built-in ones and those named in ``cfg.callbacks``.
    A failed run that created its run directory removes it only if nothing but its own start-up files
    are in it (the evidence callback); otherwise it keeps all of it and says where."""
    run_dir = RunDirectory(cfg.train.run_dir, trusted=cfg.train.trust_run_dir)
    every = build_callbacks(cfg, list(callbacks))  # before the run directory exists: what it made is known
    with hold_run_dir(run_dir, topo.is_main) as lock:
        if lock.took_over and topo.is_main:  # e.g. a requeue after the head node died: no wait on its lock
            log(f"took over the run directory lock {lock.path} of a trainer that is gone ({lock.took_over})")
        try:
            return _train(cfg, topo, callbacks=every, datasets=datasets, stop=stop or StopRequest(),
                          say=log if topo.is_main else (lambda *_: None))
        except BaseException as exc:
            for cb in every:
                cb.on_error(exc)
            raise


def _train(cfg: Config, topo, *, callbacks: list, datasets: Optional[dict], stop: StopRequest, say) -> TrainResult:
    apply_thread_policy(cfg.train.threads or None, log=say)
    plan = topo.plan  # built and validated once by the command (megafixed.run_plan), before any group
    checkpointer = Checkpointer(cfg, topo, RunIdentity.of(cfg, plan))
    resume = checkpointer.resume_point()  # verified and checked before anything in the run dir is touched
    for cb in callbacks:  # e.g. a drill that cannot fire here is refused, before anything is touched
        cb.preflight(topo, resume, say)
    checkpointer.set_damaged_aside(resume, say)  # the damaged checkpoints the resume passed over
    datasets = _datasets(cfg) if datasets is None else datasets
    engine = build_engine(cfg, topo, hook=CallbackHooks(callbacks))  # the step asks the callbacks
    seed_everything(cfg.train.seed + 1 + topo.rank)  # dropout differs per rank; initial weights do not
    done, consumed, client = _start(cfg, topo, engine, checkpointer, resume, say)
    shrunk, record = shrink_note(resume, topo)  # a requeue on fewer nodes: re-laid out, said once
    checkpointer.note(**record)
    if shrunk:
        say(shrunk)
    _write_run_files(cfg, topo)  # only now: a refused resume must not replace the run's own files
    run = RunContext(cfg=cfg, topo=topo, engine=engine, run_dir=Path(cfg.train.run_dir), say=say,
                     checkpointer=checkpointer, stop=stop, callbacks=callbacks, datasets=datasets,
                     resume_step=done, done=done, consumed=consumed)
    for cb in callbacks:
        cb.setup(run)
    _load_states(callbacks, client)
    say(_start_line(cfg, plan))
    plan_choice.note(checkpointer, say)
    result = _loop(run, LRSchedule.from_config(cfg.schedule, cfg.optimizer, cfg.train.max_steps))
    if resume is not None and run.done == tag_step(resume.tag) and not result.stopped:
        say(f"nothing to do: the run already reached train.max_steps={cfg.train.max_steps}")
    result.resumed_from = resume and resume.tag
    return result


def _loop(run: RunContext, schedule: LRSchedule) -> TrainResult:
    """Step and save, from ``run.done`` steps and ``run.consumed`` samples to train.max_steps; every
    callback's hooks on the way (``callbacks/base.py``: which hook when)."""
    from ..data.gpt_dataset import micro_batches

    cfg, topo, engine, checkpointer, callbacks = run.cfg, run.topo, run.engine, run.checkpointer, run.callbacks
    layout, max_steps = topo.plan.batch, cfg.train.max_steps

    def call(hook: str, *args) -> None:  # every callback's ``hook``, in the list's order
        for cb in callbacks:
            getattr(cb, hook)(*args)

    def batches_from(start: int):
        return micro_batches(run.datasets["train"], start_sample=start, micro_batch=layout.micro_batch,
                             dp_rank=topo.dp_rank, dp_size=topo.dp, num_workers=cfg.data.num_workers)

    def run_state() -> dict:  # what a checkpoint holds besides the engine's state and the position
        return {"schedule": schedule.state_dict(), "config": cfg.to_dict(),
                "callbacks": {cb.name: cb.state_dict() for cb in callbacks}}

    def compute(step: int, batches):  # one computation of ``step`` (a re-check computes it again, same data)
        call("before_compute", step)
        out = engine.train_step(batches, run.lr, step)
        call("after_compute", step)
        return out

    batches, first_done, last_loss = batches_from(run.consumed), run.done, None
    call("on_start")
    stopped = run.halt
    while run.done < max_steps and not stopped:
        step = run.done + 1  # as numbered in the logs
        run.lr, run.record_now = schedule.lr_at(run.done), False
        call("before_step", step)
        if any(cb.skips_step(step) for cb in callbacks):  # no forward: the step's data is consumed
            run.result = _consume(batches, layout.accum)
        else:
            result = compute(step, _step_batches(callbacks, step, batches))
            for cb in callbacks:  # a verdict re-checked, then acted on
                result = cb.settle_step(step, result, again=lambda again_batches, s=step: compute(s, again_batches))
            if isinstance(result, Rewind):  # reloaded a checkpoint before the bad step
                run.done, run.consumed = result.step, result.consumed_samples
                batches = batches_from(run.consumed)
                _load_states(callbacks, result.client)
                continue
            run.result, last_loss = result, result.loss
        run.done, run.consumed = step, run.consumed + layout.global_batch
        call("after_step", step)
        stopped = run.stop.should_stop() or bool(run.leaving)  # (callbacks decide alike on every rank)
        if stopped or checkpointer.due(step):
            call("before_save", step)
            call("after_save", step, checkpointer.save(engine, step, run.consumed, run_state, force=True))
    checkpointer.wait(engine)  # the run ends with `latest` on its last checkpoint (async saves complete)
    if stopped and not run.leaving and run.done > first_done:  # (a stop during the step-0 validation saved nothing)
        run.say(f"stopped at step {run.done} ({run.stop.reason}); checkpoint "
                f"{checkpointer.ckpt_dir / checkpointer.latest} is complete. Run the same command again to resume.")
    call("on_stop", run.done)
    return TrainResult(run_dir=str(run.run_dir), step=run.done, consumed_samples=run.consumed, resumed_from=None,
                       last_loss=last_loss, last_val_loss=run.last_val_loss, checkpoint=checkpointer.latest,
                       stopped=stopped, history=run.history, leaving=run.leaving)


def _step_batches(callbacks: list, step: int, batches):
    """The iterator ``step`` pulls its micro batches from, as the callbacks hand it on (one may keep them)."""
    for cb in callbacks:
        batches = cb.step_batches(step, batches)
    return batches


def _consume(batches, accum: int) -> None:
    """A skipped step: its ``accum`` micro batches pulled without a forward (and without RNG)."""
    for _ in range(accum):
        next(batches)


def _load_states(callbacks: list, client: Optional[dict]) -> None:
    """Every callback's state from a checkpoint's client state (None: a new run, nothing to restore)."""
    if client is None:
        return
    states = client.get("callbacks", {})
    for cb in callbacks:
        if cb.name in states:
            cb.load_state_dict(states[cb.name])


def _datasets(cfg) -> dict:
    if cfg.data.mock:
        from ..data.mock import build_mock_datasets
        return build_mock_datasets(cfg.data, cfg.model.vocab_size, seed=cfg.train.seed)
    from ..data.gpt_dataset import build_datasets  # refuses an empty training split itself
    return build_datasets(cfg.data, seed=cfg.train.seed)


def _start(cfg, topo, engine, checkpointer, resume, say) -> tuple[int, int, Optional[dict]]:
    """(steps done, consumed samples, client state) to start from: a resumed checkpoint's, else 0 (maybe
    from other weights) and None."""
    if resume is not None:
        client = checkpointer.load(engine, resume)
        step, consumed = int(client["step"]), int(client["consumed_samples"])
        say(f"resumed from {resume.tag_dir} (step {step}, {consumed} samples consumed)"
            + (f"; changed: {', '.join(resume.changes)}" if resume.changes else ""))
        return step, consumed, client
    if cfg.train.init_from:  # a new run starting from other weights (e.g. `megafixed import hf`)
        from .init_from import load_initial_weights
        say(load_initial_weights(engine, cfg, topo))
    return 0, 0, None


def _write_run_files(cfg, topo) -> None:
    if not topo.is_main:
        return
    run_dir = RunDirectory(cfg.train.run_dir)
    run_dir.path.mkdir(parents=True, exist_ok=True)
    save_config(cfg, str(run_dir.config_file))
    record = engine_config(cfg, topo.plan)  # what the engine was built with, for the machine its plan is for
    atomic_write_text(run_dir.engine_config_file(topo.plan.engine), json.dumps(record, indent=2) + "\n")


def _cp_words(plan) -> str:
    """``cp 2 (ulysses), `` in the start line under context parallelism; nothing without it."""
    return f"cp {plan.cp} ({plan.cp_method}), " if plan.cp > 1 else ""


def _start_line(cfg, plan) -> str:
    b = plan.batch
    return (f"training {cfg.model.input} interface: {cfg.train.max_steps} steps, global batch {b.global_batch} "
            f"= micro {b.micro_batch} x accum {b.accum} x dp {plan.dp}, tp {plan.tp}, {_cp_words(plan)}pp {plan.pp}, "
            f"{plan.precision}, {plan.engine_plan.start_words}, run dir {Path(cfg.train.run_dir)}")
