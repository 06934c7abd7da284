"""Batch arithmetic and the DeepSpeed config dict built from our typed config."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import Config, ConfigError


@dataclass(frozen=True)
class BatchLayout:
    global_batch: int  # sequences per optimizer step, all data-parallel ranks together
    micro_batch: int  # sequences per forward/backward on one rank
    accum: int  # micro batches per optimizer step on one rank
    dp: int

    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.accum


def batch_layout(cfg: Config, dp: int) -> BatchLayout:
    """Reconcile global = micro * accum * dp; refuse layouts that do not divide, naming the fix."""
    g, mb = cfg.train.global_batch, cfg.train.micro_batch
    if g < 1 or mb < 1:
        raise ConfigError(f"train.global_batch={g} and train.micro_batch={mb} must both be >= 1")
    if g % (mb * dp):
        lo = (g // (mb * dp)) * mb * dp
        hint = f"e.g. train.global_batch={lo or mb * dp} or {lo + mb * dp}"
        raise ConfigError(f"train.global_batch={g} is not divisible by train.micro_batch * data-parallel size "
                          f"= {mb} * {dp} = {mb * dp}; pick a global batch that is a multiple ({hint}) "
                          f"or change train.micro_batch")
    return BatchLayout(global_batch=g, micro_batch=mb, accum=g // (mb * dp), dp=dp)


def resolve_precision(cfg: Config) -> str:
    """``auto`` means bf16 on a GPU and fp32 on CPU (CPU bf16 matmuls are slow and inexact)."""
    p = cfg.train.precision
    if p == "auto":
        return "bf16" if torch.cuda.is_available() else "fp32"
    if p in ("bf16", "fp16") and not torch.cuda.is_available():
        raise ConfigError(f"train.precision={p} needs a GPU; on CPU use train.precision=fp32 (or auto)")
    return p


def deepspeed_config(cfg: Config, layout: BatchLayout, precision: str) -> dict:
    zero = {"stage": cfg.zero.stage, "reduce_bucket_size": cfg.zero.reduce_bucket_size,
            "allgather_bucket_size": cfg.zero.reduce_bucket_size}
    if cfg.zero.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_batch_size": layout.global_batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.accum,
        "gradient_clipping": cfg.optimizer.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        # Our client optimizer is torch's AdamW: tested by everyone, but not on DeepSpeed's list.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        # We log ourselves; DeepSpeed's own step prints would interleave with the progress line.
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
