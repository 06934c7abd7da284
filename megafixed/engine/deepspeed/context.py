"""Context parallelism on the DeepSpeed engine: DeepSpeed-Ulysses' own ``DistributedAttention``
around every attention core (``megafixed.parallel.context.shard_model`` puts it there and starts
each rank's RoPE tables at its first position).

``DistributedAttention`` (DeepSpeed 0.19) takes ``(q, k, v, batch_dim_idx, rotary_pos_emb, *args,
**kwargs)`` and hands ``*args, **kwargs`` to the core; our core is called ``core(q, k, v, *, mask,
causal, dropout_p)`` on batch-first ``[B, T, heads, hd]``, hence the adapter. Its GQA handling reads
the key/value head count for all four all-to-alls (queries included), and splits unevenly when that
count does not divide cp; our core repeats keys and values to the query heads itself, so the adapter
repeats them first in that case (more bytes, the same numbers) and DeepSpeed always splits evenly.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...parallel.context import ContextParallelCore


class UlyssesCore(ContextParallelCore):
    """An attention core behind DeepSpeed's ``DistributedAttention`` over ``group`` (``size`` ranks)."""

    def __init__(self, core: nn.Module, group, size: int):
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        self.size = size
        self.inner = core  # what whole_sequences runs (the same module DistributedAttention holds)
        # batch-first: the heads (dim 2) are scattered and the positions (dim 1) gathered
        self.dist_attn = DistributedAttention(core, group, scatter_idx=2, gather_idx=1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if k.shape[2] % self.size:
            group = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        return self.dist_attn(q, k, v, 0, None, **kwargs)


def shard_for_context_parallel(model: nn.Module, topo, seq_len: int) -> nn.Module:
    """``model`` as context-parallel rank ``topo.cp_rank`` of ``topo.cp`` runs it (unchanged when cp is 1)."""
    if topo.cp == 1:
        return model
    from ...parallel.context import shard_model

    return shard_model(model, topo.cp_rank, topo.cp, seq_len, lambda core: UlyssesCore(core, topo.cp_group, topo.cp))
