"""Held-out loss during training, on the same samples whatever the data-parallel layout."""
from __future__ import annotations

from typing import Callable, Optional


def mean_of_batches(loss_of_batch: Callable[[], float], batches: int, stop=None) -> Optional[float]:
    """The mean of ``batches`` calls of ``loss_of_batch`` (one global batch each); None when a stop
    request arrives between two of them. The one averaging of validation (a held-out scorer
    over a per-batch loss callable can take its place)."""
    total = 0.0
    for _ in range(batches):
        if stop is not None and stop.should_stop():
            return None
        total += loss_of_batch()
    return total / batches


class Validator:
    """``train.eval_iters`` global batches of the validation split (Megatron's meaning), scored
    from its first sample each time, every ``train.eval_interval`` steps and at the last step.
    Polls the stop request between batches, so a stop is honoured inside a long validation pass
    (``run`` returns None: the pass was cut short)."""

    def __init__(self, engine, dataset, cfg, topo, layout, stop=None):
        self.engine, self.dataset, self.topo, self.layout, self.stop = engine, dataset, topo, layout, stop
        self.iters, self.interval, self.last_step = cfg.train.eval_iters, cfg.train.eval_interval, cfg.train.max_steps

    @property
    def enabled(self) -> bool:
        return self.dataset is not None and self.iters > 0 and self.interval > 0

    def should_validate(self, step: int) -> bool:
        """Step 0 (the curve's starting point, ~ln vocab), every ``eval_interval`` steps, the last step."""
        return self.enabled and (step == 0 or step == self.last_step or step % self.interval == 0)

    def run(self) -> Optional[float]:
        from ..data.gpt_dataset import micro_batches

        batches = micro_batches(self.dataset, start_sample=0, micro_batch=self.layout.micro_batch,
                                dp_rank=self.topo.dp_rank, dp_size=self.topo.dp)
        return mean_of_batches(lambda: self.engine.eval_loss(batches, self.layout.accum), self.iters, self.stop)
