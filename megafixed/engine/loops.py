"""The step and eval loops' common skeleton, for any engine that runs micro batches itself.

What both engines do alike lives here: pulling ``accum`` micro batches and splitting each into
inputs and labels on the device, summing their losses in float64 (so the logged loss does not
depend on the compute dtype or the accumulation order), the DP mean every rank agrees on with
one non-finite flag (``batches.dp_mean_and_flag``), the bad-step verdict and the loss tap
(``loss_verdict``, ``norm_verdict``, ``scaled_loss``), and the eval loop's float64 mean over micro
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
                     vocab_size: Optional[int], dp: int, dp_group) -> tuple[float, bool]:
    """Run ``micro_step`` over ``accum`` micro batches; the loss mean over them and the DP ranks,
    and whether any rank saw a non-finite loss (every rank returns the same pair)."""
    local_sum = torch.zeros((), dtype=torch.float64, device=device)
    for k in range(accum):
        inputs, labels = split_tokens(next(batches), device, vocab_size)
        local_sum += micro_step(k, inputs, labels).detach().double()
    return dp_mean_and_flag(local_sum / accum, dp_group, dp)


# The bad-step guard and the loss tap, as both engines' steps ask them: the ``StepChecks`` the engine was
# built with (``base.StepChecks``). An engine built without them (a benchmark) has neither: a non-finite loss
# then follows ``train.on_nonfinite`` as it always did (``stop`` raises here), and nothing else is judged.
# ``step`` is numbered as in the logs (the first optimizer step is 1), as verdicts and faults are.
def scaled_loss(loss, faults, step: int):
    """``loss`` as the step's loss tap (``StepChecks.faults``: an injected fault's factor, the re-check's
    note of it) hands it on to the backward; ``loss`` itself without a tap."""
    return loss if faults is None else faults.loss(loss, step)


@contextmanager
def faults_in_loss_fn(owner, attr: str, faults, step: int):
    """Around one step of a pipeline schedule: ``owner.<attr>``, the loss function the schedule itself calls
    for every micro batch on the last stage, passes its losses through the tap as ``scaled_loss`` would (so
    the gradients carry an injected fault too). Under a pipeline only the last stage's ranks hold a loss: a
    ``rank=R`` fault on another stage has nothing to change. A tap with nothing to do at this step leaves
    the function as it is."""
    if faults is None or not faults.touches(step):
        yield
        return
    original = getattr(owner, attr)
    setattr(owner, attr, lambda *args, **kwargs: scaled_loss(original(*args, **kwargs), faults, step))
    try:
        yield
    finally:
        setattr(owner, attr, original)


def loss_verdict(guard, step: int, value: float, nonfinite: bool, on_nonfinite: str):
    """The verdict on the step's global-batch loss (already all-reduced: identical on every rank)."""
    if guard is not None:
        return guard.judge(step, "loss", float("nan") if nonfinite else value)
    if not nonfinite:
        return None
    if on_nonfinite == "stop":
        raise NonFiniteLossError(nonfinite_message(step, value))
    from ..run.bad_steps import Verdict

    return Verdict(step, "nonfinite", "loss", value, on_nonfinite)


def norm_verdict(guard, step: int, norm: Optional[float]):
    """The verdict on the global gradient norm the update would clip with (identical on every rank)."""
    return guard.judge(step, "grad_norm", norm) if guard is not None else None


def eval_mean(batches: Iterator[torch.Tensor], iters: int, forward: Forward, *, device,
              vocab_size: Optional[int], dp: int, dp_group) -> float:
    """Mean of ``forward(inputs, labels)`` over ``iters`` micro batches, then over the DP ranks."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(iters):
        inputs, labels = split_tokens(next(batches), device, vocab_size)
        total += forward(inputs, labels).double()
    return dp_mean(total / iters, dp_group, dp)
