"""``to_empty``: storage for a model built on the meta device, without torch's Python meta path.

``Module.to_empty`` calls ``torch.empty_like(t, device=...)`` on each meta tensor; for a meta tensor that
runs torch's Python reference (``torch._refs.empty_like``), whose first call imports sympy and
``torch.fx.experimental.symbolic_shapes``: about 0.35 s of start-up per rank, spent by both engines
before the first step. ``torch.empty_strided`` with the tensor's own size, stride and dtype is a C++
call and returns what ``empty_like`` does for a contiguous tensor, which every parameter and buffer of
a freshly built GPT is; anything else (a tensor subclass, a DTensor, a non-contiguous view) still
goes through ``empty_like``. ``tests/test_startup_imports.py`` compares the two on a whole model.
"""
from __future__ import annotations

import torch
from torch import nn


def _empty(t: torch.Tensor, device) -> torch.Tensor:
    if type(t) in (torch.Tensor, nn.Parameter) and t.is_contiguous():
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
    return torch.empty_like(t, device=device)


def to_empty(module: nn.Module, device) -> nn.Module:
    """``module.to_empty(device=device)`` (new, uninitialised storage for every parameter and buffer)."""
    return module._apply(lambda t: _empty(t, device))
