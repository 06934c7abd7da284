"""``train(cfg, topo)``: the training loop of one rank, on any number of nodes. It reads top to
bottom: resume, then step, validate, log, save, stop; each component decides when it acts. The
engine (``megafixed.engine``: model, optimizer, the step, its checkpoint files), the checkpointer
(``checkpoint.py``: the commit protocol, the resume check with its fall-back past a damaged checkpoint,
its cadence), validation (``validation.py``), the step log (``step_log.py``: metrics records and progress
lines), the stop request (``stop.py``), and what a long run needs when something goes wrong -- each piece
with its own state, the way OLMo-core makes callbacks of them: the bad-step guard with its re-check and
rollback (``guard.py``), the hang watchdog (``watchdog.py``), the straggler report (``stragglers.py``),
the skipped data (``run/skip_steps.py``), the drills (``run/faults.py``), and the evidence a failed run
leaves (``evidence.py``). Steps are numbered as in the logs everywhere: step 1 is the first update, and
after it ``done == 1``.

Reproducibility contract (CPU, fp32): the same command twice, or a run killed and started again,
logs bit-identical losses. What makes that true: every parameter's initial value is a function
of (seed, name); the data position is the number of consumed samples (the sample order is a pure
function of the seed); the learning rate is a pure function of the step; checkpoints carry the
optimizer moments and every rank's python/numpy/torch RNG state.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from .. import pause as pauses
from ..atomic import atomic_write_text
from ..config import Config, save_config
from ..engine import StepChecks, build_engine
from ..run import plan_choice
from ..run.bad_steps import BadStepGuard
from ..run.faults import ENV, FaultPlan, InjectError
from ..run.run_dir import RunDirectory, tag_step
from ..run.run_lock import hold_run_dir
from ..run.skip_steps import SkipSteps, spelled
from ..threads import apply_thread_policy
from .checkpoint import Checkpointer, RunIdentity
from .evidence import RunFiles, set_aside_earlier_attempt
from .guard import GuardedSteps, RolledBack
from .recheck import LossTap
from .resume import shrink_note
from .schedule import LRSchedule
from .step_log import StepLog
from .stop import StopRequest
from .stragglers import Stragglers
from .validation import Validator
from .wandb_log import WandbLog
from .watchdog import HangWatchdog


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
    leaving: list = field(default_factory=list)  # nodes with train.max_transient_faults (saved; exit 77)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def train(cfg: Config, topo, *, datasets: Optional[dict] = None, stop: Optional[StopRequest] = None,
          log: Callable[[str], None] = print) -> TrainResult:
    """Train (or resume) the run described by ``cfg`` on this rank of ``topo``, as the run
    directory's only writer (``run_lock``: a second trainer is refused before it reads anything).
    A failed run that created its run directory removes it only if nothing but its own start-up files
    are in it (``evidence.py``); otherwise it keeps all of it and says where."""
    run_dir = RunDirectory(cfg.train.run_dir, trusted=cfg.train.trust_run_dir)
    made = RunFiles(run_dir.path, created=not run_dir.path.exists())
    with hold_run_dir(run_dir, topo.is_main) as lock:
        if lock.took_over and topo.is_main:  # e.g. a requeue after the head node died: no wait on its lock
            log(f"took over the run directory lock {lock.path} of a trainer that is gone ({lock.took_over})")
        try:
            return _train(cfg, topo, datasets=datasets, stop=stop or StopRequest(), made=made,
                          say=log if topo.is_main else (lambda *_: None))
        except BaseException as exc:
            kept = made.after_failure() if topo.is_main else None
            if kept and isinstance(exc, Exception):
                exc.add_note(kept)  # the exit line says where (errors.report prints the notes)
            raise


def _train(cfg: Config, topo, *, datasets: Optional[dict], stop: StopRequest, made: RunFiles, say) -> TrainResult:
    apply_thread_policy(cfg.train.threads or None, log=say)
    plan = topo.plan  # built and validated once by the command (megafixed.run_plan), before any group
    checkpointer = Checkpointer(cfg.train, topo, RunIdentity.of(cfg, plan))
    resume = checkpointer.resume_point()  # verified and checked before anything in the run dir is touched
    faults = FaultPlan.from_env(topo.rank)  # MEGAFIXED_INJECT (None: no drill; one `is None` per step)
    if faults is not None:  # a drill that cannot fire here is refused, before anything is touched
        refusal = faults.refusal(topo.world_size, cfg.train.max_steps, _drill_done(resume))
        if refusal:
            raise InjectError(refusal)
    checkpointer.set_damaged_aside(resume, say)  # the damaged checkpoints the resume passed over
    if resume is None and topo.is_main:
        set_aside_earlier_attempt(checkpointer.run_dir.path, say)
    sinks = [WandbLog(cfg, Path(cfg.train.run_dir))] if cfg.train.wandb and topo.is_main else []
    datasets = _datasets(cfg) if datasets is None else datasets
    guard = BadStepGuard.from_config(cfg.train)  # judges each step's reduced loss and norm, before its update
    tap = LossTap.for_run(faults, recheck=cfg.train.recheck_bad_steps)  # what every micro batch's loss passes
    engine = build_engine(cfg, topo, checks=StepChecks(guard=guard, faults=tap))
    seed_everything(cfg.train.seed + 1 + topo.rank)  # dropout differs per rank; initial weights do not
    done, consumed, client = _start(cfg, topo, engine, checkpointer, resume, say)
    shrunk, record = shrink_note(resume, topo)  # a requeue on fewer nodes: re-laid out, said once
    checkpointer.note(**record)
    if shrunk:
        say(shrunk)
    _write_run_files(cfg, topo, engine)  # only now: a refused resume must not replace the run's own files
    faults_dir = checkpointer.run_dir.faults_dir
    steps = StepLog(cfg.train, cfg.model, cfg.data.seq_len, topo, engine, resume_step=done, sinks=sinks, say=say)
    skips = SkipSteps(list(cfg.data.skip_steps), faults_dir)  # data.skip_steps and the rollbacks' windows
    guarded = GuardedSteps(guard, tap, cfg.train, topo, engine=engine, checkpointer=checkpointer, skips=skips,
                           steps=steps, say=say)
    guarded.load_state_dict((client or {}).get("bad_steps"))
    run = _Run(engine=engine, checkpointer=checkpointer, steps=steps, skips=skips, guarded=guarded, faults=faults,
               validator=Validator(engine, datasets.get("valid"), cfg.train, topo, stop),
               schedule=LRSchedule.from_config(cfg.schedule, cfg.optimizer, cfg.train.max_steps),
               watchdog=HangWatchdog.for_run(cfg.train.hang_timeout_s, cfg.parallel.collective_timeout_s, topo,
                                             faults_dir, say, done=done),
               stragglers=Stragglers(engine, topo, factor=cfg.train.straggler_factor, faults_dir=faults_dir, say=say,
                                     slow=faults.slow_down if faults is not None and faults.slow else None))
    say(_start_line(cfg, plan))
    _say_drills(faults, skips, checkpointer, say)
    return _loop(cfg, topo, run, datasets["train"], done=done, consumed=consumed, resume=resume, stop=stop,
                 made=made, say=say)


@dataclass
class _Run:
    """The parts the loop asks, each with its own state."""
    engine: object
    checkpointer: Checkpointer
    steps: StepLog  # the metrics records and progress lines
    skips: SkipSteps  # steps whose data is consumed without training
    guarded: GuardedSteps  # the bad-step guard with its re-check and rollback
    faults: Optional[FaultPlan]  # the drill (MEGAFIXED_INJECT)
    validator: Validator
    schedule: LRSchedule
    watchdog: HangWatchdog
    stragglers: Stragglers


def _loop(cfg: Config, topo, run: _Run, train_data, *, done: int, consumed: int, resume, stop: StopRequest,
          made: RunFiles, say) -> TrainResult:
    """Step, validate, log, save, stop -- from ``done`` steps and ``consumed`` samples to train.max_steps."""
    from ..data.gpt_dataset import micro_batches

    layout, engine, checkpointer, steps, guarded, watchdog = (topo.plan.batch, run.engine, run.checkpointer,
                                                              run.steps, run.guarded, run.watchdog)

    def batches_from(start: int):
        return micro_batches(train_data, start_sample=start, micro_batch=layout.micro_batch, dp_rank=topo.dp_rank,
                             dp_size=topo.dp, num_workers=cfg.data.num_workers)

    def run_state() -> dict:  # what a checkpoint holds besides the engine's state and the position
        return {"schedule": run.schedule.state_dict(), "config": cfg.to_dict(), "bad_steps": guarded.state_dict()}

    def compute(step: int, lr: float, data):
        """One computation of ``step`` (a re-check of a bad step computes it again, on the same data)."""
        watchdog.start()  # once: the first step's allowance counts from here
        if run.faults is not None:
            run.faults.before_step(step)  # an injected exit or hang happens here: this rank never enters the step
        with steps.timing(), watchdog.step(step), run.stragglers.timing():
            return engine.train_step(data, lr, step)

    batches = batches_from(consumed)
    last_loss = last_val = None
    stopped, first_done, leaving = False, done, []
    pause = pauses.armed("train.step", rank=topo.rank)  # MEGAFIXED_PAUSE: a test catches the run between steps
    try:
        if done == 0 and run.validator.should_validate(0):
            val0 = run.validator.run()  # the curve's starting point (~ln vocab); consumes no RNG
            stopped = val0 is None  # a stop arrived during the pass: nothing to save yet
            if val0 is not None:
                steps.initial_validation(val0)
        if topo.is_main:
            made.first_step()  # what is in a new run directory now is the trainer's own
        while done < cfg.train.max_steps and not stopped:
            step, lr = done + 1, run.schedule.lr_at(done)  # step: as numbered in the logs
            if pause is not None:  # before step: the metrics and checkpoint of the one before are written
                pause.reached(step)
            if run.skips.consume(step, batches, layout.accum):  # data.skip_steps / a rollback's window: no forward
                watchdog.touch(step)
                result = None
            else:
                result = guarded.after(step, compute(step, lr, guarded.keep(batches)),
                                       again=partial(compute, step, lr))  # a verdict re-checked, then acted on
                if isinstance(result, RolledBack):  # reloaded the newest verified checkpoint before the bad step
                    done, consumed = result.step, result.consumed_samples
                    batches = batches_from(consumed)
                    continue
                last_loss = result.loss
            done, consumed = step, consumed + layout.global_batch
            with watchdog.grace():
                val = run.validator.run() if run.validator.should_validate(done) else None
            last_val = val if val is not None else last_val
            steps.record(done, lr, result, val, consumed, extra=run.stragglers.fields)
            leaving = guarded.leaving if done < cfg.train.max_steps else []  # (a finished run has nothing to move)
            stopped = stop.should_stop() or bool(leaving)  # (the guard decides alike on every rank)
            with watchdog.grace():
                if checkpointer.save(engine, done, consumed, run_state, force=stopped):
                    steps.not_charged()  # do not charge the save to tokens/s
        with watchdog.grace():
            checkpointer.wait(engine)  # the run ends with `latest` on its last checkpoint (async saves complete)
        if leaving:
            say(guarded.leave_line(checkpointer.ckpt_dir / checkpointer.latest))
        elif stopped and done > first_done:  # (a stop during the step-0 validation saved nothing)
            say(f"stopped at step {done} ({stop.reason}); checkpoint {checkpointer.ckpt_dir / checkpointer.latest} "
                f"is complete. Run the same command again to resume.")
    finally:
        watchdog.stop()
        steps.close()
    if resume is not None and done == tag_step(resume.tag) and not stopped:
        say(f"nothing to do: the run already reached train.max_steps={cfg.train.max_steps}")
    return TrainResult(run_dir=str(Path(cfg.train.run_dir)), step=done, consumed_samples=consumed,
                       resumed_from=resume and resume.tag, last_loss=last_loss, last_val_loss=last_val,
                       checkpoint=checkpointer.latest, stopped=stopped, history=steps.history,
                       leaving=leaving)


def _drill_done(resume) -> int:
    """The steps a drill can no longer reach: those the resumed checkpoint has done -- unless it was written
    under the same drill (a requeue of it goes on: its earlier faults have had their turn)."""
    if resume is None:
        return 0
    from ..run.run_record import read_run_record

    same = (read_run_record(resume.tag_dir) or {}).get("fault_injection") == os.environ.get(ENV)
    return 0 if same else tag_step(resume.tag)


def _say_drills(faults, skips, checkpointer, say) -> None:
    """The skipped data and the injected faults, in a line each at the start; a drill is in every run record."""
    if skips:
        say(f"skipping the batches of steps {spelled(skips.ranges)} (data.skip_steps"
            + (f" and rollbacks recorded in {skips.file}" if skips.rolled_back else "") + ")")
    if faults is not None:
        checkpointer.note(fault_injection=os.environ.get(ENV))
        say(f"fault injection: {'; '.join(f.spelled() for f in faults.every_rank)} ({ENV})")
    plan_choice.note(checkpointer, say)


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


def _write_run_files(cfg, topo, engine) -> None:
    if not topo.is_main:
        return
    run_dir = RunDirectory(cfg.train.run_dir)
    run_dir.path.mkdir(parents=True, exist_ok=True)
    save_config(cfg, str(run_dir.config_file))
    record = engine.config_record()
    if record is not None:
        atomic_write_text(run_dir.engine_config_file(engine.name), json.dumps(record, indent=2) + "\n")


def _start_line(cfg, plan) -> str:
    b = plan.batch
    return (f"training {cfg.model.input} interface: {cfg.train.max_steps} steps, global batch {b.global_batch} "
            f"= micro {b.micro_batch} x accum {b.accum} x dp {plan.dp}, tp {plan.tp}, pp {plan.pp}, "
            f"{plan.precision}, {_engine_words(plan)}, run dir {Path(cfg.train.run_dir)}")


def _engine_words(plan) -> str:
    """``zero 1`` (DeepSpeed) or ``torch engine, FSDP2 dp 2`` / ``HSDP 2x2``: what shards the state,
    in the plan's engine's own words."""
    from ..engines import kind_of

    return kind_of(plan).start_words(plan)
