"""``train(cfg, topo)``: the training loop of one rank, on any number of nodes. It reads top to
bottom: resume, then step, validate, log, save, stop; each component decides when it acts. The
engine (``megafixed.engine``: model, optimizer, the step, its checkpoint files), the checkpointer
(``checkpoint.py``: the commit protocol, the resume check, its cadence), validation
(``validation.py``), the step log (``step_log.py``: metrics records and progress lines) and the
stop request (``stop.py``).

Reproducibility contract (CPU, fp32): the same command twice, or a run killed and started again,
logs bit-identical losses. What makes that true: every parameter's initial value is a function
of (seed, name); the data position is the number of consumed samples (the sample order is a pure
function of the seed); the learning rate is a pure function of the step; checkpoints carry the
optimizer moments and every rank's python/numpy/torch RNG state.
"""
from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from .. import pause as pauses
from ..atomic import atomic_write_text
from ..config import Config, save_config
from ..engine import build_engine
from ..run.run_dir import RunDirectory, tag_step
from ..run.run_lock import hold_run_dir
from ..threads import apply_thread_policy
from .checkpoint import Checkpointer, RunIdentity
from .resilience import Resilience
from .schedule import LRSchedule
from .step_log import StepLog
from .stop import StopRequest
from .validation import Validator
from .wandb_log import WandbLog


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def train(cfg: Config, topo, *, datasets: Optional[dict] = None, stop: Optional[StopRequest] = None,
          log: Callable[[str], None] = print) -> TrainResult:
    """Train (or resume) the run described by ``cfg`` on this rank of ``topo``, as the run
    directory's only writer (``run_lock``: a second trainer is refused before it reads anything).
    A failed run that created its run directory and saved nothing leaves nothing behind."""
    run_dir = RunDirectory(cfg.train.run_dir)
    created = not run_dir.path.exists()
    with hold_run_dir(run_dir, topo.is_main) as lock:
        if lock.took_over and topo.is_main:  # e.g. a requeue after the head node died: no wait on its lock
            log(f"took over the run directory lock {lock.path} of a trainer that is gone ({lock.took_over})")
        try:
            return _train(cfg, topo, datasets=datasets, stop=stop or StopRequest(),
                          say=log if topo.is_main else (lambda *_: None))
        except BaseException:
            if created and topo.is_main and not run_dir.tags():
                shutil.rmtree(run_dir.path, ignore_errors=True)
            raise


def _train(cfg: Config, topo, *, datasets: Optional[dict], stop: StopRequest, say) -> TrainResult:
    apply_thread_policy(cfg.train.threads or None, log=say)
    plan = topo.plan  # built and validated once by the command (megafixed.run_plan), before any group
    plan.check_made_from(cfg)  # the same config's plan, not a second validation
    layout = plan.batch
    sinks = [WandbLog(cfg, Path(cfg.train.run_dir))] if cfg.train.wandb and topo.is_main else []  # fails here
    checkpointer = Checkpointer(cfg.train, topo, RunIdentity.of(cfg, plan))
    resume = checkpointer.resume_point()  # verified and checked before anything in the run dir is touched
    datasets = _datasets(cfg) if datasets is None else datasets
    engine = build_engine(cfg, topo)
    seed_everything(cfg.train.seed + 1 + topo.rank)  # dropout differs per rank; initial weights do not
    step, consumed, client = _start(cfg, topo, engine, checkpointer, resume, say)
    res = Resilience(cfg.train, topo, engine, checkpointer, say, skip_steps=cfg.data.skip_steps,  # bad steps,
                     slow_phase_s=cfg.parallel.collective_timeout_s)  # skipped data, hangs, stragglers
    res.guard.load_state_dict((client or {}).get("bad_steps"))
    res.note_shrink(resume)
    _write_run_files(cfg, topo, engine)  # only now: a refused resume must not replace the run's own files
    from ..data.gpt_dataset import micro_batches

    def batches_from(start: int):
        return micro_batches(datasets["train"], start_sample=start, micro_batch=layout.micro_batch,
                             dp_rank=topo.dp_rank, dp_size=topo.dp, num_workers=cfg.data.num_workers)
    batches = batches_from(consumed)
    schedule = LRSchedule.from_config(cfg.schedule, cfg.optimizer, cfg.train.max_steps)
    validator = Validator(engine, datasets.get("valid"), cfg.train, topo, stop)
    steps = StepLog(cfg.train, cfg.model, cfg.data.seq_len, topo, engine, resume_step=step, sinks=sinks,
                    say=say)
    say(_start_line(cfg, plan))

    def run_state() -> dict:  # what a checkpoint holds besides the engine's state and the position
        return {"schedule": schedule.state_dict(), "config": cfg.to_dict(), **res.state()}

    last_loss = last_val = None
    stopped, first_step = False, step
    pause = pauses.armed("train.step", rank=topo.rank)  # MEGAFIXED_PAUSE: a test catches the run between steps
    try:
        if step == 0 and validator.should_validate(0):
            val0 = validator.run()  # the curve's starting point (~ln vocab); consumes no RNG
            stopped = val0 is None  # a stop arrived during the pass: nothing to save yet
            if val0 is not None:
                steps.initial_validation(val0)
        while step < cfg.train.max_steps and not stopped:
            if pause is not None:  # before step + 1: step's metrics and checkpoint are written
                pause.reached(step + 1)
            lr = schedule.lr_at(step)
            if res.skip_step(step, batches, layout.accum):  # data.skip_steps / a rollback's window
                result = None
            else:
                with steps.timing(), res.step(step):
                    result = engine.train_step(batches, lr, step)
                rolled_back = res.after_step(step + 1, result, steps)  # a bad step's verdict acted on
                if rolled_back is not None:
                    step, consumed = int(rolled_back["step"]), int(rolled_back["consumed_samples"])
                    batches = batches_from(consumed)
                    continue
                last_loss = result.loss
            step, consumed = step + 1, consumed + layout.global_batch
            with res.grace():
                val = validator.run() if validator.should_validate(step) else None
            last_val = val if val is not None else last_val
            steps.record(step, lr, result, val, consumed, extra=res.log_extra)
            stopped = stop.should_stop()
            with res.grace():
                if checkpointer.save(engine, step, consumed, run_state, force=stopped):
                    steps.not_charged()  # do not charge the save to tokens/s
        with res.grace():
            checkpointer.wait(engine)  # the run ends with `latest` on its last checkpoint (async saves complete)
        if stopped and step > first_step:  # (a stop during the step-0 validation saved nothing)
            say(f"stopped at step {step} ({stop.reason}); checkpoint {checkpointer.ckpt_dir / checkpointer.latest} "
                f"is complete. Run the same command again to resume.")
    finally:
        res.close()
        steps.close()
    if resume is not None and step == tag_step(resume.tag) and not stopped:
        say(f"nothing to do: the run already reached train.max_steps={cfg.train.max_steps}")
    return TrainResult(run_dir=str(Path(cfg.train.run_dir)), step=step, consumed_samples=consumed,
                       resumed_from=resume and resume.tag, last_loss=last_loss, last_val_loss=last_val,
                       checkpoint=checkpointer.latest, stopped=stopped, history=steps.history)


def _datasets(cfg) -> dict:
    if cfg.data.mock:
        from ..data.mock import build_mock_datasets
        return build_mock_datasets(cfg.data, cfg.model.vocab_size, seed=cfg.train.seed)
    from ..data.gpt_dataset import build_datasets  # refuses an empty training split itself
    return build_datasets(cfg.data, seed=cfg.train.seed)


def _start(cfg, topo, engine, checkpointer, resume, say) -> tuple[int, int, Optional[dict]]:
    """(step, consumed samples, client state) to start from: a resumed checkpoint's, else 0 (maybe from
    other weights) and None."""
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

    return kind_of(plan).hook("describe").start_words(plan)
