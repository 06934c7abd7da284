"""``train(cfg, topo)``: the training loop. It reads top to bottom: resume, then step, log,
validate, save, stop. Everything else is a component behind it: the engine (``engine.py``), the
step (``step.py``), validation (``validation.py``), checkpoints and the resume check
(``checkpoint.py``, ``resume.py``), metrics (``metrics.py``) and the stop request (``stop.py``).

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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ..atomic import atomic_write_text
from ..config import Config, save_config
from ..threads import apply_thread_policy
from . import checkpoint, manifest, universal
from .ds_config import deepspeed_config
from .engine import build_engine
from .metrics import MetricsLog, flops_per_token, matmul_param_count, peak_flops_per_gpu, progress_line
from .resume import check_resume, layout_changes, read_run_record, run_record
from .run_lock import hold_run_dir
from .schedule import LRSchedule
from .step import train_step
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


def _due(step: int, interval: int, last: int) -> bool:
    return step == last or (interval > 0 and step % interval == 0)


def train(cfg: Config, topo, *, datasets: Optional[dict] = None, stop: Optional[StopRequest] = None,
          log: Callable[[str], None] = print) -> TrainResult:
    """Train (or resume) the run described by ``cfg`` on this rank of ``topo``, as the run
    directory's only writer (``run_lock``: a second trainer is refused before it reads anything)."""
    created_run_dir = not Path(cfg.train.run_dir).exists()
    with hold_run_dir(cfg.train.run_dir, topo.is_main):
        return _train(cfg, topo, created_run_dir, datasets=datasets, stop=stop, log=log)


def _train(cfg: Config, topo, created_run_dir: bool, *, datasets: Optional[dict] = None,
           stop: Optional[StopRequest] = None, log: Callable[[str], None] = print) -> TrainResult:
    say = log if topo.is_main else (lambda *_: None)
    apply_thread_policy(cfg.train.threads or None, log=say)
    stop = stop or StopRequest()
    plan = topo.plan  # built and validated once by the command (megafixed.run_plan), before any group
    plan.check_made_from(cfg)  # the same config's plan, not a second validation
    precision, layout = plan.precision, plan.batch
    ds_config = deepspeed_config(cfg, layout, precision)
    run_dir, max_steps = Path(cfg.train.run_dir), cfg.train.max_steps
    ckpt_dir = run_dir / "checkpoints"
    sinks = [WandbLog(cfg, run_dir)] if cfg.train.wandb and topo.is_main else []  # no wandb: fails here

    # Resume point: its files verified against its manifest, then checked against the new config,
    # before anything in the run dir is touched. Another layout resumes through a universal checkpoint.
    resume_tag = checkpoint.read_latest(ckpt_dir)
    changes: list = []
    relayout = False
    if resume_tag is not None:
        manifest.verify_for_reading(ckpt_dir / resume_tag, rank=topo.rank, world=topo.world_size)
        record = read_run_record(ckpt_dir / resume_tag)
        if record is not None:
            changes = check_resume(record, cfg, topo, precision, plan.zero_stage, ckpt_dir / resume_tag)
            relayout = bool(layout_changes(record, topo, precision, plan.zero_stage))
    if relayout:
        universal.prepare(ckpt_dir / resume_tag, cfg.model, topo.is_main, log=say)

    if datasets is None and cfg.data.mock:
        from ..data.mock import build_mock_datasets
        datasets = build_mock_datasets(cfg.data, cfg.model.vocab_size, seed=cfg.train.seed)
    if datasets is None:
        from ..data.gpt_dataset import build_datasets
        datasets = build_datasets(cfg.data, seed=cfg.train.seed)
    if datasets.get("train") is None:
        raise ValueError("the training split is empty; check data.prefixes and data.split")

    bundle = build_engine(cfg, topo, universal.engine_config(ds_config) if relayout else ds_config, precision)
    engine, optimizer = bundle.engine, bundle.optimizer
    checkpoint.writer_of(engine, async_save=cfg.train.async_save)
    seed_everything(cfg.train.seed + 1 + topo.rank)  # dropout differs per rank; initial weights do not
    step = consumed = 0
    if resume_tag is not None:
        client = checkpoint.load(engine, ckpt_dir, topo.rank, universal=relayout, tag=resume_tag)
        step, consumed = int(client["step"]), int(client["consumed_samples"])
        say(f"resumed from {ckpt_dir / resume_tag} (step {step}, {consumed} samples consumed)"
            + (f"; changed: {', '.join(changes)}" if changes else ""))
    elif cfg.train.init_from:  # a new run starting from other weights (e.g. `megafixed import hf`)
        from .init_from import load_initial_weights
        say(load_initial_weights(engine, cfg, topo))
    if topo.is_main:  # only now: a refused resume must not replace the run's own files
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, str(run_dir / "config.yaml"))
        atomic_write_text(run_dir / "ds_config.json", json.dumps(ds_config, indent=2) + "\n")

    from ..data.gpt_dataset import micro_batches
    batches = micro_batches(datasets["train"], start_sample=consumed, micro_batch=layout.micro_batch,
                            dp_rank=topo.dp_rank, dp_size=topo.dp, num_workers=cfg.data.num_workers)
    schedule = LRSchedule.from_config(cfg.schedule, cfg.optimizer, max_steps)
    metrics = MetricsLog(run_dir, enabled=topo.is_main, tensorboard=cfg.train.tensorboard, resume_step=step,
                         sinks=sinks)
    validator = Validator(engine, datasets.get("valid"), layout, topo, cfg.train.eval_iters,
                          cfg.model.vocab_size, stop)
    validate = validator.enabled and cfg.train.eval_interval > 0
    tokens_per_step = layout.tokens_per_step
    peak = peak_flops_per_gpu() if engine.device.type == "cuda" else None
    flops_tok = flops_per_token(cfg.model, matmul_param_count(cfg.model), cfg.data.seq_len) if peak else None
    say(f"training {cfg.model.input} interface: {max_steps} steps, global batch {layout.global_batch} = micro "
        f"{layout.micro_batch} x accum {layout.accum} x dp {topo.dp}, tp {topo.tp}, pp {topo.pp}, {precision}, "
        f"zero {plan.zero_stage}, run dir {run_dir}")

    # What every checkpoint records besides the engine's state (the manifest, universal_checkpoint_info).
    record_now = run_record(cfg, topo, precision, plan.zero_stage)
    ckpt_meta = manifest.describe(cfg, record_now["layout"], step, consumed) if topo.is_main else {}
    uc_info = universal.client_state(cfg.model, topo.pp)

    history: list = []
    last_loss = last_val = None
    last_tag, stopped, saved_any = resume_tag, False, resume_tag is not None
    window_t, window_steps, step_times = time.perf_counter(), 0, []
    try:
        if step == 0 and validate:  # the curve's starting point (~ln vocab); consumes no RNG
            val0 = validator.run()
            stopped = val0 is None  # a stop arrived during the pass: nothing to save yet
            if val0 is not None:
                history.append({"step": 0, "val_loss": val0, "consumed_samples": 0})
                metrics.write(history[-1])
                say(f"step 0/{max_steps} | val {val0:.4f}")
        while step < max_steps and not stopped:
            lr = schedule.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            t0 = time.perf_counter()
            result = train_step(engine, optimizer, batches, layout.accum, dp=topo.dp, dp_group=topo.dp_group,
                                on_nonfinite=cfg.train.on_nonfinite, step=step, grad_sync=bundle.grad_sync,
                                vocab_size=cfg.model.vocab_size)
            step, consumed, last_loss = step + 1, consumed + layout.global_batch, result.loss
            window_steps += 1
            step_times.append(time.perf_counter() - t0)

            val = validator.run() if validate and _due(step, cfg.train.eval_interval, max_steps) else None
            last_val = val if val is not None else last_val
            if _due(step, cfg.train.log_interval, max_steps) or val is not None:
                rec = {"step": step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                       "tokens_per_s": tokens_per_step * window_steps / max(time.perf_counter() - window_t, 1e-9),
                       "consumed_samples": consumed}
                if flops_tok:
                    rec["mfu"] = rec["tokens_per_s"] * flops_tok / (peak * topo.world_size)
                if val is not None:
                    rec["val_loss"] = val
                if result.skipped:
                    rec["skipped"] = True
                metrics.write(rec)
                history.append(rec)
                recent = step_times[-50:]
                say(progress_line(rec, max_steps, (max_steps - step) * sum(recent) / len(recent)))
                window_t, window_steps = time.perf_counter(), 0

            stopped = stop.should_stop()
            if _due(step, cfg.train.save_interval, max_steps) or stopped:
                client_state = {"step": step, "consumed_samples": consumed, "schedule": schedule.state_dict(),
                                "config": cfg.to_dict(), **uc_info}
                last_tag = checkpoint.save(engine, ckpt_dir, step, client_state, cfg.train.keep_checkpoints,
                                           topo.is_main, record_now,
                                           {**ckpt_meta, **manifest.progress(step, consumed, cfg.data.seq_len)})
                saved_any = True
                window_t = time.perf_counter()  # do not charge the save to tokens/s
            if stopped:
                checkpoint.wait_for_saves(engine)  # an async save must be complete before we say so
                say(f"stopped at step {step} ({stop.reason}); checkpoint {ckpt_dir / last_tag} is complete. "
                    f"Run the same command again to resume.")
                break
        checkpoint.wait_for_saves(engine)  # the run ends with `latest` on its last checkpoint
    except BaseException:
        metrics.close()
        if created_run_dir and not saved_any and topo.is_main:
            shutil.rmtree(run_dir, ignore_errors=True)  # a failed run leaves nothing half-made behind
        raise
    metrics.close()
    if resume_tag is not None and step == checkpoint.tag_step(resume_tag) and not stopped:
        say(f"nothing to do: the run already reached train.max_steps={max_steps}")
    return TrainResult(run_dir=str(run_dir), step=step, consumed_samples=consumed, resumed_from=resume_tag,
                       last_loss=last_loss, last_val_loss=last_val, checkpoint=last_tag, stopped=stopped,
                       history=history)
