"""Micro batches on their way to any engine: the host-side token check, the pinned copy to the
device, the shifted inputs/labels views, and the data-parallel loss mean with its non-finite flag.

Engine-agnostic: the DeepSpeed engine uses these, and so will the next one.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class TokenRangeError(ValueError):
    """A batch holds a token id the model cannot embed or predict."""


def host_values(t: torch.Tensor):
    """``t.tolist()``: the step's reads of device values onto the host go through here. A fake
    tensor (``megafixed plan --fake`` runs the engine's own step under ``FakeTensorMode``) has shapes
    but no values; it reads as zeros of its shape -- a finite loss, no bad rank, a zero norm: the
    step's common path, which allocates and communicates what a real step does."""
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    if is_fake(t):
        with unset_fake_temporarily():
            return torch.zeros(t.shape, dtype=t.dtype).tolist()
    return t.tolist()


def check_token_ids(tokens: torch.Tensor, vocab_size: Optional[int]) -> None:
    """Refuse ids outside [0, vocab_size) on the host, before the copy to the device.

    The model's forward is kept free of device-to-host syncs, so this is where a mismatch between
    the data's tokenizer and ``model.vocab_size`` is caught (shards are also checked when written).
    On a CPU tensor ``aminmax`` costs microseconds and no synchronisation.
    """
    if vocab_size is None or tokens.numel() == 0 or tokens.device.type != "cpu":
        return
    lo, hi = host_values(torch.stack(torch.aminmax(tokens)))
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise TokenRangeError(f"token id {bad} is outside [0, {vocab_size - 1}] (model.vocab_size={vocab_size}); "
                              f"the data was tokenized with a different vocabulary than this config: check "
                              f"data.tokenizer and model.vocab_size")


def pinned_for(tokens: torch.Tensor, device) -> torch.Tensor:
    """``tokens`` in page-locked host memory when they are bound for a CUDA device.

    A ``non_blocking`` copy from pageable memory is synchronous (the driver stages it through its
    own pinned buffer while the host waits); from pinned memory it is a DMA queued on the stream.
    Pinning a micro batch is a host memcpy of a few hundred KiB into torch's caching host allocator,
    which also keeps the block alive until the copy that reads it has finished.
    """
    if torch.device(device).type != "cuda" or tokens.device.type != "cpu" or tokens.is_pinned():
        return tokens
    return tokens.pin_memory()


def split_tokens(tokens: torch.Tensor, device, vocab_size: Optional[int] = None,
                 shard: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro batch ``[mb, seq_len + 1]`` as (inputs, labels), the two shifted views, on ``device``.

    ``shard``: (this rank's context-parallel coordinate, cp): its contiguous slice of the positions of
    both (``megafixed.parallel.context.shard_tokens``), so that each label stays beside its input."""
    from ..parallel.context import shard_tokens

    check_token_ids(tokens, vocab_size)
    rank, size = shard
    tokens = pinned_for(tokens, device).to(device, non_blocking=True)
    return shard_tokens(tokens[:, :-1], rank, size), shard_tokens(tokens[:, 1:], rank, size)


def dp_mean_and_flag(local_mean: torch.Tensor, dp_group, dp: int) -> tuple[float, bool]:
    """All ranks agree on the global-batch loss and on whether any rank saw a non-finite loss."""
    stats = torch.stack([torch.nan_to_num(local_mean, nan=0.0, posinf=0.0, neginf=0.0),
                         (~torch.isfinite(local_mean)).float()]).double()
    if dp > 1:
        dist.all_reduce(stats, group=dp_group)
    mean, bad = host_values(stats)  # one read of both
    nonfinite = bad > 0
    return (float("nan") if nonfinite else mean / dp), nonfinite


def dp_mean(local_mean: torch.Tensor, dp_group, dp: int) -> float:
    """The mean of one float64 value per data-parallel rank."""
    total = local_mean.clone()
    if dp > 1:
        dist.all_reduce(total, group=dp_group)
    return float(total) / dp


def none_if_nan(x) -> Optional[float]:
    if x is None:
        return None
    x = float(x)
    return x if x == x else None
