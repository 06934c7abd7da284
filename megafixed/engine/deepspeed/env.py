"""Process environment that must be in place BEFORE ``import deepspeed``.

DeepSpeed picks its accelerator at import time and JIT-builds ops into TORCH_EXTENSIONS_DIR;
on a CPU machine without ``DS_ACCELERATOR=cpu`` it probes for CUDA and fails in odd places.
``prepare_runtime_env()`` also checks the engine versions (``megafixed.versions``) and filters
known-harmless library noise (``quiet_library_noise``); every verb that uses the engines calls it.
"""
from __future__ import annotations

import logging
import os

from ...versions import check_engines
from .ops import extensions_dir

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
    # A universal-checkpoint load without TP (no mpu): tp size 1 is exactly right (engine/deepspeed/universal.py).
    ("DeepSpeed", "MPU is not provided, setting tp size to 1 in checkpoint loading"),
)
# Python warnings megatron-core raises on import or first use, about paths megafixed never takes:
# (message regex, module regex, only_without_cuda). Matched on message AND the warning module, so the
# same words from elsewhere still show. Under pytest torch's "torch.jit.script_method is deprecated"
# (from torch.utils.mkldnn) appears too; that is the test runner's business, not the user's.
HARMLESS_WARNINGS = (
    # Its FSDP mixed precision, optimizers and grad clipping fall back from TE/Apex kernels: megafixed
    # uses none of them (torch.optim.AdamW inside DeepSpeed; our own clip and norms).
    (r"Transformer Engine and Apex are not installed", r"megatron\.core\.", False),
    (r"Apex is not installed\. Falling back to Torch Norm", r"megatron\.core\.", False),
    # A CUDA scheduling hint for TP/SP comm overlap; on a CPU run there is no CUDA to schedule.
    (r".*CUDA_DEVICE_MAX_CONNECTIONS", r"megatron\.core\.", True),
)


class _DropHarmless(logging.Filter):
    def __init__(self, needles: tuple[str, ...]):
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in self.needles)


def quiet_library_noise(cuda: bool | None = None) -> None:
    """Install the log and warning filters above (idempotent). A filter on a named logger survives the
    library's own set-up of that logger (DeepSpeed sets level and handler at import but keeps filters),
    so this works before or after ``import deepspeed``; the warning filters must precede megatron's
    import (its warnings fire at import time)."""
    import warnings

    for message, module, only_without_cuda in HARMLESS_WARNINGS:
        if not (only_without_cuda and cuda):
            warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
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

    cuda = torch.cuda.is_available()
    quiet_library_noise(cuda)  # first: megatron-core warns at import
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # JIT-built ops go to the user cache (not the install tree), one folder per environment and CPU
    # kind, so that two environments never rebuild over each other (engine/deepspeed/ops.py).
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))


def accelerator_name() -> str:
    """The accelerator DeepSpeed picked at import ("cuda", "cpu", ...)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()
