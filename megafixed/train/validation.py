"""Held-out loss during training, on the same samples whatever the data-parallel layout."""
from __future__ import annotations

from .step import eval_loss


class Validator:
    """``train.eval_iters`` global batches of the validation split (Megatron's meaning), scored
    from its first sample each time. Polls the stop request between batches, so a stop is
    honoured inside a long validation pass (returns None: the pass was cut short)."""

    def __init__(self, engine, dataset, layout, topo, iters: int, vocab_size: int, stop=None):
        self.engine, self.dataset, self.layout, self.topo = engine, dataset, layout, topo
        self.iters, self.vocab_size, self.stop = iters, vocab_size, stop

    @property
    def enabled(self) -> bool:
        return self.dataset is not None and self.iters > 0

    def run(self):
        from ..data.gpt_dataset import micro_batches

        batches = micro_batches(self.dataset, start_sample=0, micro_batch=self.layout.micro_batch,
                                dp_rank=self.topo.dp_rank, dp_size=self.topo.dp)
        total = 0.0
        for _ in range(self.iters):
            if self.stop is not None and self.stop.should_stop():
                return None
            total += eval_loss(self.engine, batches, self.layout.accum, dp=self.topo.dp,
                               dp_group=self.topo.dp_group, vocab_size=self.vocab_size)
        value = total / self.iters
        return value
