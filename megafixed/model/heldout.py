"""The one held-out scorer: mean next-token loss, token count and perplexity over token batches.

Validation during training, the quickstart's test split, the study's test loss and
``megafixed eval --text`` all score held-out text through :func:`score_heldout`, so the averaging
rule is written here once:

    loss = sum over batches of (the batch's mean loss x its scored target tokens)
           / all scored target tokens

Every target token weighs the same, whatever the batch sizes (the study's last, shorter batch;
``eval --text``'s windows of every length). When all batches are equal (validation, the
quickstart), this is the mean of the batch means, which is what those callers reported before:
a float32 batch loss times a token count is exact in float64, so the two sums round alike.

It imports only torch (and, given a model, the model's own ``forward(inputs, targets)``), so
``megafixed.train`` and ``megafixed.eval`` both use it without importing each other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

# Targets with this id are not scored (context and padding in ``eval --text``'s windows): it is
# F.cross_entropy's default ``ignore_index``, which the GPT's loss (``gpt.cross_entropy_loss``) uses.
IGNORE_INDEX = -100

Batch = Union[torch.Tensor, tuple]  # token ids [B, T+1], or an (inputs [B, T], targets [B, T]) pair
BatchLoss = Callable[[Batch], Union[float, torch.Tensor]]  # the batch's mean loss per scored target


@dataclass(frozen=True)
class HeldoutScore:
    loss: float  # mean next-token cross entropy per scored target token (nats); nan: nothing scored
    tokens: int  # scored target tokens (all data-parallel ranks)
    batches: int  # batches scored (this rank)

    @property
    def nll(self) -> float:
        """Total negative log-likelihood (nats), e.g. for bits per byte."""
        return self.loss * self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))  # capped: an untrained model's loss must not overflow


def split_batch(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a batch: a ``[B, T+1]`` token tensor is shifted by one position."""
    if isinstance(batch, torch.Tensor):
        return batch[:, :-1], batch[:, 1:]
    inputs, targets = batch
    return inputs, targets


def target_tokens(batch: Batch) -> int:
    """How many targets of ``batch`` are scored (those that are not ``IGNORE_INDEX``)."""
    return int((split_batch(batch)[1] != IGNORE_INDEX).sum())


def model_loss(model: nn.Module, device: Optional[torch.device] = None) -> BatchLoss:
    """The per-batch loss of a plain GPT: ``model(inputs, targets)`` on ``device`` (default: the
    model's). The caller puts the model in eval mode (:func:`score_heldout` does, given a model)."""
    device = device or next(model.parameters()).device

    def loss(batch: Batch) -> torch.Tensor:
        inputs, targets = split_batch(batch)
        return model(inputs.to(device), targets.to(device))

    return loss


@torch.no_grad()
def score_heldout(loss: Union[BatchLoss, nn.Module], batches: Iterable, *,
                  tokens_of: Callable[[Batch], int] = target_tokens, dp_size: int = 1, dp_group=None,
                  device: Optional[torch.device] = None,
                  should_stop: Optional[Callable[[], bool]] = None) -> Optional[HeldoutScore]:
    """Score every item of ``batches`` (consumed to its end: bound it with ``itertools.islice``).

    ``loss``: a model (scored as ``model(inputs, targets)`` in eval mode, restored afterwards) or
    a callable giving an item's mean loss per scored target, e.g. a training engine's eval step.
    ``tokens_of(item)``: how many targets the item scores (default: the non-ignored targets of a
    token batch). A caller whose items are not token batches says it, e.g. the trainer's validation
    over ``iters`` groups of ``n`` equal micro batches, each already averaged over the DP ranks::

        score_heldout(lambda _: engine.eval_loss(it, n), range(iters), tokens_of=lambda _: 1,
                      should_stop=stop.should_stop)

    (equal groups weigh alike, so a weight of 1 each gives the same mean, to the bit, as summing the
    group losses and dividing by ``iters``; ``tokens`` then counts groups.)

    ``dp_size > 1``: each data-parallel rank scored its share; the sums are all-reduced over
    ``dp_group`` (on ``device``, default the model's) so every rank returns the same score. A loss
    callable that already averages over ranks is called with the default ``dp_size=1``.
    ``should_stop()`` is polled before each item; when it says stop, None is returned (cut short).
    """
    model = loss if isinstance(loss, nn.Module) else None
    if model is not None:
        device = device or next(model.parameters()).device
        was_training = model.training
        model.eval()
        loss = model_loss(model, device)
    try:
        nll = torch.zeros((), dtype=torch.float64, device=device)  # summed where the losses are
        tokens = n = 0
        for item in batches:
            if should_stop is not None and should_stop():
                return None
            count = tokens_of(item)
            value = loss(item)
            value = value.detach().double() if isinstance(value, torch.Tensor) else float(value)
            nll = nll + value * count
            tokens += count
            n += 1
    finally:
        if model is not None:
            model.train(was_training)
    if dp_size > 1:
        device = device or nll.device  # where the losses were (NCCL reduces CUDA tensors only)
        sums = torch.stack([nll.to(device), torch.tensor(float(tokens), dtype=torch.float64, device=device)])
        dist.all_reduce(sums, group=dp_group)
        nll, tokens = sums[0], int(sums[1])
    return HeldoutScore(loss=float(nll) / tokens if tokens else math.nan, tokens=tokens, batches=n)
