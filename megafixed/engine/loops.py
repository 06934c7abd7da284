"""The step and eval loops' common skeleton, for any engine that runs micro batches itself.

What both engines do alike lives here: pulling ``accum`` micro batches and splitting each into
inputs and labels on the device, summing their losses in float64 (so the logged loss does not
depend on the compute dtype or the accumulation order), the DP mean every rank agrees on with
one non-finite flag (``batches.dp_mean_and_flag``), ``train.on_nonfinite=stop``, and the eval
loop's float64 mean over micro batches and DP ranks. What the engines do *between* (the forward
and backward of one micro batch, when gradients are reduced, how a skipped update leaves weights,
gradients and optimizer state untouched) is each engine's own and is passed in as ``micro_step``
/ ``forward``.

A DeepSpeed pipeline engine runs none of this: its schedule does the accumulation in
``train_batch`` / ``eval_batch`` (``deepspeed/step.py``).
"""
from __future__ import annotations

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


def stop_if_asked(nonfinite: bool, on_nonfinite: str, step: int, value: float) -> None:
    """``train.on_nonfinite=stop``: a non-finite loss ends the run; ``skip`` leaves it to the engine."""
    if nonfinite and on_nonfinite == "stop":
        raise NonFiniteLossError(nonfinite_message(step, value))


def eval_mean(batches: Iterator[torch.Tensor], iters: int, forward: Forward, *, device,
              vocab_size: Optional[int], dp: int, dp_group) -> float:
    """Mean of ``forward(inputs, labels)`` over ``iters`` micro batches, then over the DP ranks."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(iters):
        inputs, labels = split_tokens(next(batches), device, vocab_size)
        total += forward(inputs, labels).double()
    return dp_mean(total / iters, dp_group, dp)
