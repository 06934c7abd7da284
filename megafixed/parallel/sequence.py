"""Sequence-parallel collectives on batch-first activations, on any device and backend.

Why our own: megatron-core 0.16's sequence-parallel mappings (and its gather along the last dim)
allocate their outputs with ``torch.cuda.current_device()``, so they cannot run on CPU/gloo, where
CI tests them. These are the same operations (Megatron's "g" and "g-bar" conjugates) on dim 1
of ``[B, T, ...]`` tensors, written against torch.distributed only:

* ``gather_sequence``: all-gather the T/tp shards forward, reduce-scatter the gradient backward
  (before a column-parallel Linear).
* ``reduce_scatter_sequence``: sum partial outputs and keep this rank's T/tp shard forward,
  all-gather the gradient backward (after a row-parallel Linear or a vocab-parallel lookup).

gloo has no reduce-scatter, so there it is an all-reduce followed by taking our chunk (same
numbers, twice the traffic); NCCL uses ``reduce_scatter_tensor``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if dist.get_backend(group) == "gloo":
        full = x.contiguous().clone()
        dist.all_reduce(full, group=group)
        return full.chunk(size, dim=dim)[rank].contiguous()
    chunks = torch.stack(x.chunk(size, dim=dim)).contiguous()  # [size, ...] -> scatter dim 0
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter_tensor(out, chunks, group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 1, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 1, ctx.group), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceScatterSequence.apply(x, group)
