"""One optimizer step and one validation pass, for both kinds of DeepSpeed engine.

THE DISPATCH between them lives here (``DeepSpeedEngine`` calls these two functions): a
``deepspeed.pipe.PipelineModule`` engine runs a whole global batch in ``train_batch`` /
``eval_batch`` (its schedule does the accumulation); any other engine does forward / backward /
step per micro batch and DeepSpeed accumulates (``gradient_accumulation_steps``) and all-reduces
at the boundary.

Micro batches arrive as token tensors ``[mb, seq_len + 1]``; inputs and labels are the two
shifted views (``megafixed.engine.batches.split_tokens``).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch

from ..base import StepResult
from ..batches import none_if_nan, split_tokens
from ..loops import StepLoss, accumulated_loss, eval_mean, loss_verdict, norm_verdict, scaled_loss


def _fence_checkpoint_copies(engine) -> None:
    """An async checkpoint's device-to-host copies run on a side stream; the update that follows
    must not change the state under them (``async_save.CheckpointWriter.fence``)."""
    fence = getattr(getattr(engine, "checkpoint_engine", None), "fence", None)
    if callable(fence):
        fence()


def is_pipeline_engine(engine) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine
    return isinstance(engine, PipelineEngine)


def rank0s_values(values: list, device) -> list:
    """``values`` (floats or None) as rank 0 holds them, on every rank, in ONE tiny all-reduce over the
    job (the others add zeros, which leave rank 0's bits as they are).

    The bad-step guard needs its inputs bit-identical on every rank (its verdicts take no collective of
    their own). ZeRO's norm is DeepSpeed's: an all-reduce over DP, then one over the model-parallel
    group, and the pipeline's loss a DP all-reduce per tensor-parallel column before the pipe broadcast:
    hops through different communicators, which no library promises give every rank the same bits. So
    with a guard the step pays this one collective of a few float64s (the torch engine needs none: its
    loss and norm are one all-reduce each over the whole job)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    mine = dist.get_rank() == 0
    flat = [float(v) if (mine and v is not None) else 0.0 for v in values]
    flat += [1.0 if (mine and v is None) else 0.0 for v in values]
    t = torch.tensor(flat, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    got = t.tolist()
    n = len(values)
    return [None if got[n + i] else got[i] for i in range(n)]


def _stage0_grad_norm(engine) -> Optional[float]:
    """ZeRO 1-3 report the pre-clip norm; without ZeRO (fp32) DeepSpeed keeps none, so compute it."""
    from .grad_norm import global_grad_norm  # counts TP-replicated params once
    params = [p for p in engine.module.parameters() if p.grad is not None]
    return global_grad_norm(params, mpu=engine.mpu) if params else None


def train_step(engine, optimizer, batches: Iterator[torch.Tensor], accum: int, *, dp: int, dp_group=None,
               on_nonfinite: str = "stop", step: int = 0, grad_sync=None,
               vocab_size: Optional[int] = None, hook=None, shard: tuple[int, int] = (0, 1)) -> StepResult:
    """Run one optimizer step over ``accum`` micro batches from ``batches`` on this rank.

    ``grad_sync`` (plain engine, sequence parallelism, ZeRO 0/1) sums the sequence-parallel
    gradients over TP once, after the last micro batch's backward, and then lets DeepSpeed do
    its data-parallel reduction (``megafixed.engine.deepspeed.grads``).

    ``shard``: (context-parallel rank, cp): each micro batch's slice of positions this rank runs. Its
    loss is the mean over that slice; DeepSpeed sums gradients over the cp ranks (``mpu.ContextParallelMPU``),
    so the backward takes the loss over cp: the reduced gradient is the mean over every token.
    """
    cp = shard[1]
    engine.train()
    if is_pipeline_engine(engine):
        return _pipeline_train_step(engine, optimizer, batches, accum, on_nonfinite=on_nonfinite, step=step,
                                    vocab_size=vocab_size, hook=hook)

    def micro_step(k: int, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = scaled_loss(engine(inputs, labels), hook, step)  # an injected fault (faults.inject), if any
        engine.backward(loss / cp if cp > 1 else loss)
        if k < accum - 1:
            engine.step()  # not a boundary: DeepSpeed only counts the micro step
        elif grad_sync is not None:
            grad_sync.finish()  # one TP all-reduce of the SP gradients, at the boundary
            engine.allreduce_gradients()  # then DeepSpeed's DP reduction, which it deferred for us
        return loss

    value, nonfinite = accumulated_loss(batches, accum, micro_step, device=engine.device, vocab_size=vocab_size,
                                        dp=dp, dp_group=dp_group, shard=shard)
    # The guard judges values every rank already holds (the reduced loss, the global norm): every rank
    # reaches the same verdict with no collective of its own, and no device read is added.
    verdict = loss_verdict(hook, step, value, nonfinite, on_nonfinite)
    grad_norm, judged = None, {}
    if verdict is None and engine.zero_optimization_stage() == 0:
        grad_norm = _stage0_grad_norm(engine)  # before the update: ours to compute without ZeRO
        verdict = norm_verdict(hook, step, grad_norm)
    elif verdict is None and hook is not None:
        def judge_zero_norm() -> bool:  # inside ZeRO's step: its norm is computed, the update not yet run
            # the one read of it (also the logged norm below), rank 0's bits on every rank
            judged["norm"] = rank0s_values([_zero_grad_norm(engine)], engine.device)[0]
            judged["verdict"] = norm_verdict(hook, step, judged["norm"])
            return judged["verdict"] is not None
        optimizer.before_update = judge_zero_norm
    # skip: DeepSpeed still takes the optimizer step at the boundary (and zeroes the gradients after
    # it), so the update is turned into a no-op (run.optim.SkippableAdamW) rather than not called.
    optimizer.skip_next_step = verdict is not None
    _fence_checkpoint_copies(engine)
    engine.step()
    optimizer.skip_next_step, optimizer.before_update = False, None  # ZeRO may skip without asking us
    verdict = verdict or judged.get("verdict")
    if grad_norm is None and verdict is None:
        grad_norm = none_if_nan(judged["norm"] if "norm" in judged else engine.get_global_grad_norm())
    return StepResult(loss=value, grad_norm=grad_norm, skipped=verdict is not None, verdict=verdict)


def _pipeline_train_step(engine, optimizer, batches, accum: int, *, on_nonfinite: str, step: int,
                         vocab_size: Optional[int], hook) -> StepResult:
    """One ``train_batch`` of a DeepSpeed pipeline engine, judged before its update.

    The schedule runs the micro batches and ends in the optimizer step, all inside ``train_batch``. So the
    verdict is asked from inside that step (``SkippableAdamW.before_update``, as for ZeRO below): there
    the last stage holds the micro batches' losses and ZeRO-1 / the bf16 optimizer the update's global
    norm. The loss is the engine's own aggregate (``_aggregate_total_loss``: the DP mean, broadcast over
    the pipe group; ``train_batch`` repeats it after the update), so every rank judges the same values and
    a skip leaves every stage unchanged. The cost, with a guard: that small all-reduce and broadcast once
    more per step, and the loss's one host read moved before the update.
    """
    pairs = (split_tokens(next(batches), engine.device, vocab_size) for _ in range(accum))  # one per micro batch
    judged: dict = {}

    def judge_before_update() -> bool:
        value = float(engine._aggregate_total_loss())  # on every rank: a collective
        # ZeRO-1 and the bf16 optimizer hold the update's pre-clip norm here. fp32 without ZeRO has none:
        # DeepSpeed clipped before calling the optimizer and kept no norm, so the loss alone is judged.
        value, norm = rank0s_values([value, _zero_grad_norm(engine)], engine.device)  # the same bits everywhere
        judged["loss"] = value
        nonfinite = not math.isfinite(value)
        verdict = loss_verdict(hook, step, value, nonfinite, on_nonfinite)
        if verdict is None:
            judged["norm"] = norm
            verdict = norm_verdict(hook, step, judged["norm"])
        judged["verdict"] = verdict
        return verdict is not None

    if hook is not None:
        optimizer.before_update = judge_before_update
    _fence_checkpoint_copies(engine)  # train_batch ends in the update: no overlap to be had here
    try:
        loss_fn = engine.module.loss_fn  # a StepLoss when the engine was built with a hook (engine.py)
        with loss_fn.during(step) if isinstance(loss_fn, StepLoss) else contextlib.nullcontext():
            loss = engine.train_batch(data_iter=pairs)  # averaged over micro batches and DP, every stage
    finally:
        optimizer.skip_next_step, optimizer.before_update = False, None
    if "verdict" in judged:
        verdict = judged["verdict"]
        grad_norm = None if verdict is not None else none_if_nan(judged["norm"])
        return StepResult(loss=judged["loss"], grad_norm=grad_norm, skipped=verdict is not None, verdict=verdict)
    # Not asked: no guard (a benchmark), or ZeRO-1 / the bf16 optimizer found non-finite gradients (what a
    # non-finite loss makes) and skipped the update itself, before calling the optimizer.
    value = float(loss)
    nonfinite = not math.isfinite(value)
    verdict = loss_verdict(hook, step, value, nonfinite, on_nonfinite)
    grad_norm = none_if_nan(engine.get_global_grad_norm())
    return StepResult(loss=value, grad_norm=grad_norm, skipped=nonfinite or hook is not None,
                      verdict=verdict or norm_verdict(hook, step, grad_norm))


def _zero_grad_norm(engine):
    """The global norm ZeRO computed for this update (``DeepSpeedZeroOptimizer``/``BF16_Optimizer`` keep
    it before they call the client optimizer's step); inf when it found an overflow."""
    norm = getattr(engine.optimizer, "_global_grad_norm", None)
    return None if norm is None else float(norm)


@torch.no_grad()
def eval_loss(engine, batches: Iterator[torch.Tensor], iters: int, *, dp: int, dp_group=None,
              vocab_size: Optional[int] = None, shard: tuple[int, int] = (0, 1)) -> float:
    """Mean loss over ``iters`` micro batches per rank, averaged over data-parallel ranks (data x context
    ranks under context parallelism: ``dp``/``dp_group`` are then ``Topology.loss_group``'s)."""
    if iters < 1:
        return float("nan")
    was_training = engine.training
    if is_pipeline_engine(engine):
        pairs = (split_tokens(next(batches), engine.device, vocab_size) for _ in range(iters))
        value = float(engine.eval_batch(data_iter=pairs, num_micro_batches=iters))
    else:
        engine.eval()
        value = eval_mean(batches, iters, engine.module, device=engine.device, vocab_size=vocab_size,
                          dp=dp, dp_group=dp_group, shard=shard)
    engine.train(was_training)
    return value
