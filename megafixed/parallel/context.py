"""Context parallelism: every sequence split over ``cp`` ranks, each holding one contiguous slice.

What changes on a context-parallel rank, and nothing else does (the loop, the loss, the input
interfaces and the head all run on the rank's slice as they would on a whole sequence):

* its micro batches are its slice of the positions (``shard_tokens``): all ranks of a CP group read
  the same sequences (they share a data-parallel coordinate) and rank ``r`` keeps positions
  ``[r * T/cp, (r + 1) * T/cp)`` of the inputs and the labels alike;
* its RoPE tables start at its slice's first global position (``Rotary.offset``);
* attention sees whole sequences: Ulysses (DeepSpeed-Ulysses, arXiv 2309.14509) swaps the sequence
  split for a head split with one all-to-all per q, k and v, runs the unchanged attention core on
  all ``T`` positions of ``heads / cp`` heads, and swaps back with a fourth (``UlyssesAttention``
  here for the torch engine; DeepSpeed's own ``DistributedAttention`` for the DeepSpeed engine);
* its loss is the mean over its ``T/cp`` tokens. The shards are equal, so the mean of the CP ranks'
  means is the sequence's mean, and reducing the loss and the gradients over data x context ranks
  (``Topology.loss_group``) gives exactly what one process computes over the whole sequence.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn


def shard_tokens(t: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Context-parallel rank ``rank``'s contiguous slice of ``t`` along its position axis ``dim``."""
    if size == 1:
        return t
    n = t.shape[dim]
    if n % size:
        raise ValueError(f"{n} positions do not split into {size} equal context-parallel slices")
    return t.narrow(dim, rank * (n // size), n // size)


def _a2a(x: torch.Tensor, group) -> torch.Tensor:
    """``all_to_all_single`` over ``group`` along dim 0, with its gradient (the reverse all-to-all)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, group))


def seq_to_heads(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """``[B, T/cp, H, hd]`` (this rank's positions, every head) -> ``[B, T, H/cp, hd]`` (every position,
    this rank's heads). Rank ``r`` receives head slice ``r`` from every rank, in rank (= position) order."""
    B, t, H, hd = x.shape
    x = x.reshape(B, t, size, H // size, hd).permute(2, 0, 1, 3, 4)  # [cp (head slice), B, t, H/cp, hd]
    x = _a2a(x, group)  # [cp (position slice), B, t, H/cp, hd]
    return x.permute(1, 0, 2, 3, 4).reshape(B, size * t, H // size, hd)


def heads_to_seq(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """The inverse of ``seq_to_heads``: ``[B, T, H/cp, hd]`` -> ``[B, T/cp, H, hd]``."""
    B, T, h, hd = x.shape
    x = x.reshape(B, size, T // size, h, hd).permute(1, 0, 2, 3, 4)  # [cp (position slice), B, T/cp, h, hd]
    x = _a2a(x, group)  # [cp (head slice), B, T/cp, h, hd]
    return x.permute(1, 2, 0, 3, 4).reshape(B, T // size, size * h, hd)


class ContextParallelCore(nn.Module):
    """An attention core wrapped for context parallelism; ``inner`` is the core it wraps (what
    ``whole_sequences`` runs instead). Each engine's Ulysses is one: the torch engine's below, the
    DeepSpeed engine's around DeepSpeed's ``DistributedAttention``."""

    inner: nn.Module


class UlyssesAttention(ContextParallelCore):
    """The attention core on whole sequences for ``heads / cp`` heads: the torch engine's Ulysses.

    Keys and values whose head count does not split over ``cp`` (GQA with fewer key/value heads than
    ranks) are repeated to the query heads first: more bytes, the same numbers."""

    def __init__(self, core: nn.Module, group, size: int):
        super().__init__()
        self.inner = core
        self.group, self.size = group, size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if k.shape[2] % self.size:
            group = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        q, k, v = (seq_to_heads(t, self.group, self.size) for t in (q, k, v))
        return heads_to_seq(self.inner(q, k, v, **kwargs), self.group, self.size)


def shard_model(model: nn.Module, rank: int, size: int, seq_len: int,
                wrap: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """Make ``model`` (a ``GPT``, or a pipeline stage holding some of its blocks) context-parallel rank
    ``rank``'s of ``size``, for sequences ``seq_len`` long (the run's ``data.seq_len``): its RoPE tables
    start at the rank's first position, and every attention core becomes ``wrap(core)``
    (``lambda core: UlyssesAttention(core, group, size)``, or DeepSpeed's ``DistributedAttention``).
    Parameters and their names are untouched, so checkpoints do not depend on ``cp``."""
    if size == 1:
        return model
    from ..model.gpt import Attention, Rotary

    for m in model.modules():
        if isinstance(m, Rotary):
            m.offset = rank * (seq_len // size)
        elif isinstance(m, Attention):
            m.core = wrap(m.core)
    return model


@contextlib.contextmanager
def whole_sequences(model: nn.Module) -> Iterator[None]:
    """For its duration, ``model`` (a ``shard_model``-ed GPT, or any module holding its attention) runs
    whole sequences on every rank, as one process would: each Ulysses core is its ``inner`` core again
    and RoPE starts at position 0; what ``shard_model`` set is restored after, even on an error.

    For forwards that need every position on one rank: the packed zero-shot scorer (its ``positions``
    and ``attn_mask`` span a whole row) while the run trains context-parallel, the context-parallel
    ranks then splitting the rows among themselves as data-parallel ranks do. A no-op without CP."""
    from ..model.gpt import Attention, Rotary

    swapped = [(m, m.core) for m in model.modules()
               if isinstance(m, Attention) and isinstance(m.core, ContextParallelCore)]
    offsets = [(m, m.offset) for m in model.modules() if isinstance(m, Rotary) and m.offset]
    try:
        for m, core in swapped:
            m.core = core.inner
        for m, _ in offsets:
            m.offset = 0
        yield
    finally:
        for m, core in swapped:
            m.core = core
        for m, offset in offsets:
            m.offset = offset
