"""``train(cfg)``: the DeepSpeed training loop on one node (plain process, torchrun or deepspeed).

Order of events: environment -> process group -> batch layout -> run dir + resolved config ->
data -> model (through the parallel seam) -> client AdamW -> ``deepspeed.initialize`` -> resume
from ``latest`` -> loop (lr from the schedule, one step, log, validate, save).

Reproducibility contract (CPU, fp32): the same command twice, or a run killed and started again,
logs bit-identical losses. What makes that true: the model is built under a fixed seed; the data
position is the number of consumed samples (the sample order is a pure function of the seed);
the learning rate is a pure function of the step; checkpoints carry optimizer moments and every
rank's python/numpy/torch RNG state.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ..config import Config, save_config
from . import checkpoint
from .ds_config import batch_layout, deepspeed_config, resolve_precision
from .env import prepare_runtime_env
from .metrics import MetricsLog, flops_per_token, matmul_param_count, peak_flops_per_gpu, progress_line
from .optim import build_optimizer
from .schedule import LRSchedule
from .step import eval_loss, train_step


@dataclass
class TrainResult:
    run_dir: str
    step: int  # optimizer steps completed
    consumed_samples: int
    resumed_from: Optional[str]  # checkpoint tag we started from, if any
    last_loss: Optional[float]
    last_val_loss: Optional[float]
    checkpoint: Optional[str]  # tag of the newest checkpoint
    history: list = field(default_factory=list)  # every logged record (rank 0)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _configure_model(model, cfg: Config, precision: str) -> None:
    from ..model import GPT

    if not isinstance(model, GPT):
        return  # a PipelineModule: the parallel layer configures its stages
    model.activation_checkpointing = cfg.train.activation_checkpointing
    if model.has_fixed_input and precision in ("bf16", "fp16"):
        # The code is exactly +-scale in any float dtype; emit it in the compute dtype.
        model.input.out_dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    if cfg.train.compile:
        for block in model.blocks:
            block.compile()  # in place: parameter names (and so checkpoints) stay unchanged


def keep_fp32_buffers(module) -> None:
    """Undo DeepSpeed's cast of *buffers* to bf16/fp16 (it calls ``module.bfloat16()``).

    RoPE tables in bf16 carry ~0.4% angle error, which grows into position confusion at long
    contexts (Megatron keeps them fp32 too), and the fixed code's scale buffer must stay exact for
    the checkpoint check. Parameters keep the engine's dtype.
    """
    from ..model import GPT
    from ..model.gpt import rope_cache

    if not isinstance(module, GPT):
        return
    dev = module.rope_cos.device
    cos, sin = rope_cache(module.cfg.head_dim, module.cfg.max_seq_len, module.cfg.rope_theta)
    module.rope_cos, module.rope_sin = cos.to(dev), sin.to(dev)
    if module.has_fixed_input:
        module.input.code_scale = torch.tensor(module.input.code.scale, dtype=torch.float64, device=dev)


def _dp_group(topo):
    return topo.mpu.get_data_parallel_group() if topo.mpu is not None else None


def train(cfg: Config, *, datasets: Optional[dict] = None, log: Callable[[str], None] = print) -> TrainResult:
    """Train (or resume) the run described by ``cfg``; see the module docstring."""
    prepare_runtime_env()
    import deepspeed
    import torch.distributed as dist

    from ..parallel import build_model, setup_distributed

    topo = setup_distributed(cfg)
    layout = batch_layout(cfg, topo.dp)
    precision = resolve_precision(cfg)
    say = log if topo.is_main else (lambda *_: None)

    run_dir = Path(cfg.train.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    if topo.is_main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)

    if datasets is None:
        from ..data.gpt_dataset import build_datasets
        datasets = build_datasets(cfg.data, seed=cfg.train.seed)
    if datasets.get("train") is None:
        raise ValueError("the training split is empty; check data.prefixes and data.split")

    model = build_model(cfg, topo)
    _configure_model(model, cfg, precision)
    optimizer = build_optimizer(model, cfg.optimizer)
    # A PipelineModule carries its own process grid, and DeepSpeed refuses an mpu beside it.
    is_pipeline = isinstance(model, deepspeed.pipe.PipelineModule)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           mpu=None if is_pipeline else topo.mpu,
                                           config=deepspeed_config(cfg, layout, precision))
    if precision != "fp32":
        keep_fp32_buffers(engine.module)
    # Training randomness (dropout) differs per rank; initial weights do not (build_model seeds).
    seed_everything(cfg.train.seed + 1 + topo.rank)

    schedule = LRSchedule.from_config(cfg.schedule, cfg.optimizer, cfg.train.max_steps)
    step, consumed = 0, 0
    client = checkpoint.load(engine, ckpt_dir, topo.rank)
    resumed_from = None
    if client is not None:
        step, consumed = int(client["step"]), int(client["consumed_samples"])
        resumed_from = checkpoint.tag_for(step)
        say(f"resumed from {ckpt_dir / resumed_from} (step {step}, {consumed} samples consumed)")

    if topo.is_main:  # after a successful resume: a refused config must not replace the run's own
        save_config(cfg, str(run_dir / "config.yaml"))

    from ..data.gpt_dataset import micro_batches
    batches = micro_batches(datasets["train"], start_sample=consumed, micro_batch=layout.micro_batch,
                            dp_rank=topo.dp_rank, dp_size=topo.dp, num_workers=cfg.data.num_workers)
    metrics = MetricsLog(run_dir, enabled=topo.is_main, tensorboard=cfg.train.tensorboard, resume_step=step)
    dp_group = _dp_group(topo)
    seq_len = cfg.data.seq_len
    tokens_per_step = layout.global_batch * seq_len
    peak = peak_flops_per_gpu() if engine.device.type == "cuda" else None
    flops_tok = flops_per_token(cfg.model, matmul_param_count(cfg.model), seq_len) if peak else None

    say(f"training {cfg.model.input} interface: {cfg.train.max_steps} steps, global batch {layout.global_batch} "
        f"= micro {layout.micro_batch} x accum {layout.accum} x dp {topo.dp}, {precision}, "
        f"zero {cfg.zero.stage}, run dir {run_dir}")
    history: list = []
    last_loss = last_val = None
    has_valid = cfg.train.eval_interval > 0 and datasets.get("valid") is not None

    def validate() -> float:
        # train.eval_iters counts global batches (Megatron's meaning): the same held-out samples
        # are scored whatever the data-parallel layout.
        valid = micro_batches(datasets["valid"], start_sample=0, micro_batch=layout.micro_batch,
                              dp_rank=topo.dp_rank, dp_size=topo.dp)
        return eval_loss(engine, valid, cfg.train.eval_iters * layout.accum, dp=topo.dp, dp_group=dp_group)

    if step == 0 and has_valid:
        # The curve's starting point (~ln vocab for a fresh model); no RNG is consumed.
        rec0 = {"step": 0, "val_loss": validate(), "consumed_samples": 0}
        metrics.write(rec0)
        history.append(rec0)
        say(f"step 0/{cfg.train.max_steps} | val {rec0['val_loss']:.4f}")
    last_tag = resumed_from
    window_t, window_steps = time.perf_counter(), 0
    step_times: list = []
    try:
        while step < cfg.train.max_steps:
            lr = schedule.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            t0 = time.perf_counter()
            result = train_step(engine, optimizer, batches, layout.accum, dp=topo.dp, dp_group=dp_group,
                                on_nonfinite=cfg.train.on_nonfinite, step=step)
            step += 1
            consumed += layout.global_batch
            window_steps += 1
            step_times.append(time.perf_counter() - t0)
            last_loss = result.loss

            do_log = step % cfg.train.log_interval == 0 or step == cfg.train.max_steps
            do_eval = has_valid and (step % cfg.train.eval_interval == 0 or step == cfg.train.max_steps)
            val = last_val = validate() if do_eval else last_val
            if do_log or do_eval:
                elapsed = time.perf_counter() - window_t
                rec = {"step": step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                       "tokens_per_s": tokens_per_step * window_steps / max(elapsed, 1e-9),
                       "consumed_samples": consumed}
                if flops_tok:
                    rec["mfu"] = rec["tokens_per_s"] * flops_tok / (peak * topo.world_size)
                if do_eval:
                    rec["val_loss"] = val
                if result.skipped:
                    rec["skipped"] = True
                recent = step_times[-50:]
                eta = (cfg.train.max_steps - step) * sum(recent) / len(recent)
                metrics.write(rec)
                history.append(rec)
                say(progress_line(rec, cfg.train.max_steps, eta))
                window_t, window_steps = time.perf_counter(), 0

            if step % cfg.train.save_interval == 0 or step == cfg.train.max_steps:
                client_state = {"step": step, "consumed_samples": consumed, "schedule": schedule.state_dict(),
                                "config": cfg.to_dict()}
                last_tag = checkpoint.save(engine, ckpt_dir, step, client_state, cfg.train.keep_checkpoints,
                                           topo.is_main)
                window_t = time.perf_counter()  # do not charge the save to tokens/s
    finally:
        metrics.close()
    if dist.is_initialized():
        dist.barrier()
    if resumed_from is not None and step == int(resumed_from.split("_")[1]):
        say(f"nothing to do: the run already reached train.max_steps={cfg.train.max_steps}")
    return TrainResult(run_dir=str(run_dir), step=step, consumed_samples=consumed, resumed_from=resumed_from,
                       last_loss=last_loss, last_val_loss=last_val, checkpoint=last_tag, history=history)
