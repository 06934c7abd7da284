"""Process environment that must be in place BEFORE ``import deepspeed``.

DeepSpeed picks its accelerator at import time and JIT-builds ops into TORCH_EXTENSIONS_DIR;
on a CPU machine without ``DS_ACCELERATOR=cpu`` it probes for CUDA and fails in odd places.
``prepare_runtime_env()`` also checks the engine versions (``megafixed.versions``) and filters
known-harmless library noise (``quiet_library_noise``); every verb that uses the engines calls it.
"""
from __future__ import annotations

import logging
import os

from ..versions import check_engines
from .ds_ops import extensions_dir

# Library noise, filtered in this one place. Each entry is a message that fires on every run of ours
# and tells the user nothing actionable; anything else from these libraries still gets through.
# (logger name, message substring)
HARMLESS_LOG_MESSAGES = (
    # The accelerator probe on a machine without CUDA: CPU is what we asked for (DS_ACCELERATOR is set
    # below; `megafixed plan` imports DeepSpeed without needing an accelerator at all).
    ("DeepSpeed", "Setting accelerator to CPU"),
    # DeepSpeed only whitelists its own optimizers; ours is torch.optim.AdamW with parameter groups,
    # which ZeRO 1-3 handle -- the parallel tests check losses against a single process to 1e-5.
    ("DeepSpeed", "You are using ZeRO with an untested optimizer"),
    # A universal-checkpoint load without TP (no mpu): tp size 1 is exactly right (train/universal.py).
    ("DeepSpeed", "MPU is not provided, setting tp size to 1 in checkpoint loading"),
)
# No python `warnings` need filtering: a CLI run (train, quickstart, plan) shows none today. Under
# pytest torch's "torch.jit.script_method is deprecated" (from torch.utils.mkldnn) appears; that is
# the test runner's business, not the user's.


class _DropHarmless(logging.Filter):
    def __init__(self, needles: tuple[str, ...]):
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in self.needles)


def quiet_library_noise() -> None:
    """Install the log filters above (idempotent). A filter on a named logger survives the library's own
    set-up of that logger (DeepSpeed sets level and handler at import but keeps filters), so this
    works before or after ``import deepspeed``."""
    by_logger: dict[str, tuple[str, ...]] = {}
    for name, needle in HARMLESS_LOG_MESSAGES:
        by_logger[name] = by_logger.get(name, ()) + (needle,)
    for name, needles in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropHarmless) for f in logger.filters):
            logger.addFilter(_DropHarmless(needles))


def prepare_runtime_env() -> None:
    check_engines()  # an untested DeepSpeed/megatron-core fails here with one line, not mid-run
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # JIT-built ops go to the user cache (not the install tree), one folder per environment and CPU
    # kind, so that two environments never rebuild over each other (train/ds_ops.py).
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    quiet_library_noise()
