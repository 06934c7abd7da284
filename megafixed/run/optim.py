"""The client optimizer handed to DeepSpeed: torch's AdamW with Megatron-style parameter groups.

Weight decay applies to matrices only. No decay on norm weights and biases (standard), and -- our
choice -- none on a learned input embedding either (``optimizer.embedding_weight_decay`` turns it
on): decaying the table pulls rare tokens' rows towards zero, which would handicap the learned
control against fixed codes, whose inputs keep unit RMS by construction. The output head is a
regular matrix and is decayed in all three interfaces, so the backbones are treated identically.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import OptimizerConfig
from .dynamo_free import defer_dynamo_disable, step_without_dynamo


def param_groups(model: nn.Module, opt: OptimizerConfig) -> list[dict]:
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        is_embedding = "embedding" in name.split(".")
        if p.dim() < 2 or (is_embedding and not opt.embedding_weight_decay):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": opt.weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


class SkippableAdamW(torch.optim.AdamW):
    """AdamW whose next ``step()`` can be turned into a no-op.

    ``guard.on_nonfinite=skip`` must drop a batch *without* an update, yet DeepSpeed takes the
    optimizer step itself at the accumulation boundary. The trainer decides (identically on every
    rank, after an all-reduce) and sets ``skip_next_step``; the step then leaves parameters and
    moments untouched. ZeRO 1/2 additionally skip on non-finite gradients on their own.

    The step and the bookkeeping methods do not import ``torch._dynamo`` when nothing compiles
    (``run/dynamo_free.py``: about a CPU-second per rank at start-up).
    """

    def __init__(self, *args, **kwargs):
        defer_dynamo_disable()  # before super().__init__: it calls add_param_group
        super().__init__(*args, **kwargs)
        self.skip_next_step = False
        # Asked once, at the first step() call of an update, where the engine already holds the update's
        # global gradient norm (ZeRO computes and clips with it just before): True skips the update.
        self.before_update = None

    @torch.no_grad()
    def step(self, closure=None):
        # The engine clears the flag after its whole update: ZeRO 1/2 call step() once per parameter
        # group (``_optimizer_step``), and every group of a skipped update must be skipped.
        if not self.skip_next_step and self.before_update is not None:
            ask, self.before_update = self.before_update, None
            self.skip_next_step = bool(ask())
        if self.skip_next_step:
            return None
        return step_without_dynamo(self, torch.optim.AdamW.step, closure)


def build_optimizer(model: nn.Module, opt: OptimizerConfig) -> SkippableAdamW:
    return SkippableAdamW(param_groups(model, opt), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                          weight_decay=opt.weight_decay)
