"""``train.precision`` resolved: the one compute precision of a run (engine-agnostic)."""
from __future__ import annotations

from typing import Optional

import torch

from ..config import Config, ConfigError


def resolve_precision(cfg: Config, gpu: Optional[bool] = None) -> str:
    """``auto`` means bf16 on a GPU and fp32 on CPU (CPU bf16 matmuls are slow and inexact).

    ``gpu`` is the machine the run is *for*: ``--dry-run`` on a CPU login node plans a GPU run.
    """
    gpu = torch.cuda.is_available() if gpu is None else gpu
    p = cfg.train.precision
    if p == "auto":
        return "bf16" if gpu else "fp32"
    if p in ("bf16", "fp16") and not gpu:
        raise ConfigError(f"train.precision={p} needs a GPU; on CPU use train.precision=fp32 (or auto)")
    return p
