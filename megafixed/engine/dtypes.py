"""The compute dtype of each precision, and the buffers that must stay exact after an engine
casts the module to it (engine-agnostic)."""
from __future__ import annotations

import torch

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def restore_exact_buffers(module) -> None:
    """Rewrite buffers that must stay exact after an engine casts the module to bf16/fp16 (the
    fixed code's scale). RoPE tables need nothing: they are an fp32 cache, not buffers."""
    for sub in module.modules():
        if hasattr(sub, "reset_buffers"):
            sub.reset_buffers()
