"""One optimizer step and one validation pass, for both kinds of DeepSpeed engine.

THE DISPATCH lives here and only here: a ``deepspeed.pipe.PipelineModule`` engine runs a whole
global batch in ``train_batch`` / ``eval_batch`` (its schedule does the accumulation); any other
engine does forward / backward / step per micro batch and DeepSpeed accumulates
(``gradient_accumulation_steps``) and all-reduces at the boundary.

Micro batches arrive as token tensors ``[mb, seq_len + 1]``; inputs and labels are the two
shifted views.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN/Inf and ``train.on_nonfinite=stop``."""


@dataclass
class StepResult:
    loss: float  # mean over the global batch (all data-parallel ranks)
    grad_norm: Optional[float]
    skipped: bool  # non-finite loss with on_nonfinite=skip: the update was dropped


class TokenRangeError(ValueError):
    """A batch holds a token id the model cannot embed or predict."""


def check_token_ids(tokens: torch.Tensor, vocab_size: Optional[int]) -> None:
    """Refuse ids outside [0, vocab_size) on the host, before the copy to the device.

    The model's forward is kept free of device-to-host syncs, so this is where a mismatch between
    the data's tokenizer and ``model.vocab_size`` is caught (shards are also checked when written).
    On a CPU tensor ``aminmax`` costs microseconds and no synchronisation.
    """
    if vocab_size is None or tokens.numel() == 0 or tokens.device.type != "cpu":
        return
    lo, hi = (int(v) for v in torch.aminmax(tokens))
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


def split_tokens(tokens: torch.Tensor, device, vocab_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    check_token_ids(tokens, vocab_size)
    tokens = pinned_for(tokens, device).to(device, non_blocking=True)
    return tokens[:, :-1], tokens[:, 1:]


def _fence_checkpoint_copies(engine) -> None:
    """An async checkpoint's device-to-host copies run on a side stream; the update that follows
    must not change the state under them (``megafixed.train.async_save.CheckpointWriter.fence``)."""
    fence = getattr(getattr(engine, "checkpoint_engine", None), "fence", None)
    if callable(fence):
        fence()


def is_pipeline_engine(engine) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine
    return isinstance(engine, PipelineEngine)


def _dp_mean_and_flag(local_mean: torch.Tensor, dp_group, dp: int) -> tuple[float, bool]:
    """All ranks agree on the global-batch loss and on whether any rank saw a non-finite loss."""
    stats = torch.stack([torch.nan_to_num(local_mean, nan=0.0, posinf=0.0, neginf=0.0),
                         (~torch.isfinite(local_mean)).float()]).double()
    if dp > 1:
        dist.all_reduce(stats, group=dp_group)
    nonfinite = bool(stats[1] > 0)
    return (float("nan") if nonfinite else float(stats[0]) / dp), nonfinite


def _stage0_grad_norm(engine) -> Optional[float]:
    """ZeRO 1-3 report the pre-clip norm; without ZeRO (fp32) DeepSpeed keeps none, so compute it."""
    from ..parallel.grad_norm import global_grad_norm  # counts TP-replicated params once
    params = [p for p in engine.module.parameters() if p.grad is not None]
    return global_grad_norm(params, mpu=engine.mpu) if params else None


def train_step(engine, optimizer, batches: Iterator[torch.Tensor], accum: int, *, dp: int, dp_group=None,
               on_nonfinite: str = "stop", step: int = 0, grad_sync=None,
               vocab_size: Optional[int] = None) -> StepResult:
    """Run one optimizer step over ``accum`` micro batches from ``batches`` on this rank.

    ``grad_sync`` (plain engine, sequence parallelism, ZeRO 0/1) sums the sequence-parallel
    gradients over TP once, after the last micro batch's backward, and then lets DeepSpeed do
    its data-parallel reduction (``megafixed.parallel.grads``).
    """
    engine.train()
    if is_pipeline_engine(engine):
        # Exactly `accum` pairs: the pipeline schedule pulls one per micro batch on its first/last stage.
        pairs = (split_tokens(next(batches), engine.device, vocab_size) for _ in range(accum))
        _fence_checkpoint_copies(engine)  # train_batch ends in the update: no overlap to be had here
        loss = engine.train_batch(data_iter=pairs)  # already averaged over micro batches and DP
        value = float(loss)
        nonfinite = not torch.isfinite(torch.tensor(value))
        if nonfinite and on_nonfinite == "stop":
            raise NonFiniteLossError(_nonfinite_message(step, value))
        # With ZeRO-1 (the pipeline engine's maximum) DeepSpeed itself skips an update whose
        # gradients are non-finite, which is what a non-finite loss produces.
        return StepResult(loss=value, grad_norm=_none_if_nan(engine.get_global_grad_norm()), skipped=nonfinite)

    local_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
    for k in range(accum):
        inputs, labels = split_tokens(next(batches), engine.device, vocab_size)
        loss = engine(inputs, labels)
        engine.backward(loss)
        local_sum += loss.detach().double()
        if k < accum - 1:
            engine.step()  # not a boundary: DeepSpeed only counts the micro step
        elif grad_sync is not None:
            grad_sync.finish()  # one TP all-reduce of the SP gradients, at the boundary
            engine.allreduce_gradients()  # then DeepSpeed's DP reduction, which it deferred for us
    value, nonfinite = _dp_mean_and_flag(local_sum / accum, dp_group, dp)
    if nonfinite:
        if on_nonfinite == "stop":
            raise NonFiniteLossError(_nonfinite_message(step, value))
        optimizer.skip_next_step = True
    grad_norm = None
    if not nonfinite and engine.zero_optimization_stage() == 0:
        grad_norm = _stage0_grad_norm(engine)
    _fence_checkpoint_copies(engine)
    engine.step()
    optimizer.skip_next_step = False  # ZeRO may have skipped on its own without consuming the flag
    if grad_norm is None and not nonfinite:
        grad_norm = _none_if_nan(engine.get_global_grad_norm())
    return StepResult(loss=value, grad_norm=grad_norm, skipped=nonfinite)


@torch.no_grad()
def eval_loss(engine, batches: Iterator[torch.Tensor], iters: int, *, dp: int, dp_group=None,
              vocab_size: Optional[int] = None) -> float:
    """Mean loss over ``iters`` micro batches per rank, averaged over data-parallel ranks."""
    if iters < 1:
        return float("nan")
    was_training = engine.training
    if is_pipeline_engine(engine):
        pairs = (split_tokens(next(batches), engine.device, vocab_size) for _ in range(iters))
        value = float(engine.eval_batch(data_iter=pairs, num_micro_batches=iters))
    else:
        engine.eval()
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        for _ in range(iters):
            inputs, labels = split_tokens(next(batches), engine.device, vocab_size)
            total += engine.module(inputs, labels).double()
        total /= iters
        if dp > 1:
            dist.all_reduce(total, group=dp_group)
        value = float(total) / dp
    engine.train(was_training)
    return value


def _none_if_nan(x) -> Optional[float]:
    if x is None:
        return None
    x = float(x)
    return x if x == x else None


def _nonfinite_message(step: int, value: float) -> str:
    return (f"step {step + 1}: the training loss is {value} (non-finite). The run stops here; the last "
            f"checkpoint is intact. Usual fixes: lower optimizer.lr or raise schedule.warmup_steps, lower "
            f"optimizer.grad_clip, check the data for bad token ids; or set train.on_nonfinite=skip to drop "
            f"such batches without an update")
