"""Held-out loss / perplexity of a plain model over a dataset split, and loading a trained model.

Reusable outside the trainer: ``megafixed quickstart`` calls these on the final checkpoint, and
later evaluation work can call them on any GPT built from a config (generation: ``model.generate``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

# The one loading path lives beneath both the trainer and megafixed.eval (which the trainer's in-loop
# evaluation imports): read from here by the trainer, the commands and the tests.
from ..engine.trained import _run_config, load_trained_model, trained_state_dict  # noqa: F401


@dataclass
class EvalResult:
    loss: float  # mean next-token cross entropy (nats)
    perplexity: float
    tokens: int  # target tokens scored (all ranks)
    batches: int  # micro batches per rank


@torch.no_grad()
def evaluate_loss(cfg, model: nn.Module, dataset, *, micro_batch: Optional[int] = None,
                  max_batches: Optional[int] = None, dp_rank: int = 0, dp_size: int = 1, dp_group=None,
                  device: Optional[torch.device] = None) -> EvalResult:
    """Mean loss of ``model`` (a GPT, called as ``model(inputs, targets)``) over a dataset split.

    Walks the split from its first sample, each DP rank taking its share, for at most
    ``max_batches`` micro batches per rank (None: the whole split, whole micro batches only).
    """
    from ..data.gpt_dataset import micro_batches

    if dataset is None:
        raise ValueError("this data split is empty; give it a share in data.split (e.g. '98,1,1')")
    mb = micro_batch or cfg.train.micro_batch
    available = len(dataset) // (mb * dp_size)
    n = available if max_batches is None else min(max_batches, available)
    if n < 1:
        raise ValueError(f"the split has {len(dataset)} samples, fewer than one micro batch of {mb} per rank "
                         f"x {dp_size} ranks; lower train.micro_batch or give the split a larger data.split share")
    from itertools import islice

    from ..model.heldout import score_heldout

    it = micro_batches(dataset, start_sample=0, micro_batch=mb, dp_rank=dp_rank, dp_size=dp_size)
    score = score_heldout(model, islice(it, n), dp_size=dp_size, dp_group=dp_group, device=device)
    return EvalResult(loss=score.loss, perplexity=score.perplexity, tokens=score.tokens, batches=n)
