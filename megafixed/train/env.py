"""Process environment that must be in place BEFORE ``import deepspeed``.

DeepSpeed picks its accelerator at import time and JIT-builds ops into TORCH_EXTENSIONS_DIR;
on a CPU machine without ``DS_ACCELERATOR=cpu`` it probes for CUDA and fails in odd places.
"""
from __future__ import annotations

import os
from pathlib import Path


def prepare_runtime_env() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "megafixed" / "torch_extensions"))
