"""Parameter counts of a config, computed on the meta device (no memory is allocated).

Counts come from instantiating the real ``GPT`` with meta tensors, not from a formula, so they
cannot drift from the model code. Shared (tied) parameters are counted once.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch import nn

from .config import ModelConfig


@dataclass
class ParamCount:
    total: int  # every parameter, counted once
    trainable: int  # requires_grad parameters
    input: int  # the input interface (0 for fixed codes)
    head: int  # final norm + output projection
    blocks: list = field(default_factory=list)  # per transformer block
    other: int = 0  # anything not in input / blocks / head
    code_buffers: int = 0  # elements of the fixed code's A/b/scale buffers (not parameters)

    def to_dict(self) -> dict:
        return asdict(self)


def _unique_numel(params, seen: set[int]) -> int:
    n = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def count_model(model: nn.Module) -> ParamCount:
    """Break down a built ``GPT`` (any device, including meta)."""
    seen: set[int] = set()
    input_n = _unique_numel(model.input.parameters(), seen)
    block_n = [_unique_numel(b.parameters(), seen) for b in model.blocks]
    head_n = _unique_numel(model.head.parameters(), set())  # a tied head still "has" its matrix
    _unique_numel(model.head.parameters(), seen)
    other = _unique_numel(model.parameters(), seen)
    unique = {id(p): p for p in model.parameters()}.values()
    code_buffers = sum(b.numel() for n, b in model.input.named_buffers() if n.startswith("code_"))
    return ParamCount(total=sum(p.numel() for p in unique),
                      trainable=sum(p.numel() for p in unique if p.requires_grad),
                      input=input_n, head=head_n, blocks=block_n, other=other, code_buffers=code_buffers)


def count_params(model_cfg: ModelConfig) -> ParamCount:
    """Counts for a model config without allocating it (meta device)."""
    from .gpt import meta_gpt

    return count_model(meta_gpt(model_cfg))
