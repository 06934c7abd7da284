"""The step and eval loops' common skeleton, for any engine that runs micro batches itself.

What both engines do alike lives here: pulling ``accum`` micro batches and splitting each into
inputs and labels on the device, summing their losses in float64 (so the logged loss does not
depend on the compute dtype or the accumulation order), the DP mean every rank agrees on with
one non-finite flag (``batches.dp_mean_and_flag``), what the step hook is asked
(``loss_verdict``, ``norm_verdict``, ``scaled_loss``, ``StepLoss``), and the eval loop's float64 mean over micro
batches and DP ranks. What the engines do *between* (the forward and backward of one micro batch,
when gradients are reduced, how a skipped update leaves weights, gradients and optimizer state
untouched) is each engine's own and is passed in as ``micro_step`` / ``forward``.

A DeepSpeed pipeline engine runs none of this: its schedule does the accumulation in
``train_batch`` / ``eval_batch`` (``deepspeed/step.py``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

from .base import NonFiniteLossError, nonfinite_message
from .batches import dp_mean, dp_mean_and_flag, split_tokens

# (micro batch index, inputs, labels) -> that micro batch's loss (its backward done)
MicroStep = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# (inputs, labels) -> that micro batch's loss, no gradients
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def accumulated_loss(batches: Iterator[torch.Tensor], accum: int, micro_step: MicroStep, *, device,
                     vocab_size: Optional[int], dp: int, dp_group,
                     shard: tuple[int, int] = (0, 1)) -> tuple[float, bool]:
    """Run ``micro_step`` over ``accum`` micro batches; the loss mean over them and the DP ranks,
    and whether any rank saw a non-finite loss (every rank returns the same pair). ``shard``: (cp
    rank, cp), this rank's context-parallel slice of each sequence (``batches.split_tokens``)."""
    local_sum = torch.zeros((), dtype=torch.float64, device=device)
    for k in range(accum):
        inputs, labels = split_tokens(next(batches), device, vocab_size, shard=shard)
        local_sum += micro_step(k, inputs, labels).detach().double()
    return dp_mean_and_flag(local_sum / accum, dp_group, dp)


# The engine's step hook (``base.StepHook``, given when the engine was built), as both engines' steps ask it.
# An engine built without one (a benchmark) judges nothing: a non-finite loss then follows
# ``guard.on_nonfinite`` as it always did (``stop`` raises here). ``step`` is numbered as in the logs (the
# first optimizer step is 1), as verdicts and drills are.
def scaled_loss(loss, hook, step: int):
    """``loss`` as the step hook hands it on to the backward (a drill's factor, the re-check's note of it);
    ``loss`` itself without a hook."""
    return loss if hook is None else hook.loss(loss, step)


class StepLoss:
    """A pipeline schedule's loss function -- the schedule calls it itself for every micro batch on the last
    stage -- passing each loss through the step hook as ``scaled_loss`` would, while a training step is in
    flight (``during``; so the gradients carry an injected fault too), and as it is otherwise (validation).
    Under a pipeline only the last stage's ranks hold a loss: a ``rank=R`` drill on another stage has nothing
    to change."""

    def __init__(self, loss_fn, hook):
        self.loss_fn, self.hook, self.step = loss_fn, hook, None

    def __call__(self, *args, **kwargs):
        loss = self.loss_fn(*args, **kwargs)
        return loss if self.step is None else scaled_loss(loss, self.hook, self.step)

    @contextmanager
    def during(self, step: int):
        self.step = step
        try:
            yield
        finally:
            self.step = None


def loss_verdict(hook, step: int, value: float, nonfinite: bool, on_nonfinite: str):
    """The verdict on the step's global-batch loss (already all-reduced: identical on every rank)."""
    if hook is not None:
        return hook.judge(step, "loss", float("nan") if nonfinite else value)
    if not nonfinite:
        return None
    if on_nonfinite == "stop":
        raise NonFiniteLossError(nonfinite_message(step, value))
    from ..run.bad_steps import Verdict

    return Verdict(step, "nonfinite", "loss", value, on_nonfinite)


def norm_verdict(hook, step: int, norm: Optional[float]):
    """The verdict on the global gradient norm the update would clip with (identical on every rank)."""
    return hook.judge(step, "grad_norm", norm) if hook is not None else None


def eval_mean(batches: Iterator[torch.Tensor], iters: int, forward: Forward, *, device,
              vocab_size: Optional[int], dp: int, dp_group, shard: tuple[int, int] = (0, 1)) -> float:
    """Mean of ``forward(inputs, labels)`` over ``iters`` micro batches, then over the DP ranks
    (``dp_group``/``dp``: dp x cp under context parallelism, each rank with its ``shard``)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(iters):
        inputs, labels = split_tokens(next(batches), device, vocab_size, shard=shard)
        total += forward(inputs, labels).double()
    return dp_mean(total / iters, dp_group, dp)
