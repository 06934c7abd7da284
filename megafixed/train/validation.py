"""Held-out loss during training, on the same samples whatever the data-parallel layout."""
from __future__ import annotations

from typing import Optional

from ..model.heldout import score_heldout


class Validator:
    """``validation.iters`` global batches of the validation split (Megatron's meaning), scored
    from its first sample each time, every ``validation.interval`` steps and at the last step.
    Polls the stop request between batches, so a stop is honoured inside a long validation pass
    (``run`` returns None: the pass was cut short)."""

    def __init__(self, engine, dataset, validation, max_steps: int, topo, stop=None):
        """``validation``: the config's ``validation`` section (iters, interval); ``topo``:
        the DP rank and size, and its plan's batch layout."""
        self.engine, self.dataset, self.topo, self.layout, self.stop = engine, dataset, topo, topo.plan.batch, stop
        self.iters, self.interval, self.last_step = validation.iters, validation.interval, max_steps

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
        # The one held-out scorer: ``iters`` groups of ``accum`` micro batches, each group's loss already
        # averaged over the data-parallel ranks by the engine; equal groups weigh 1 each.
        score = score_heldout(lambda _: self.engine.eval_loss(batches, self.layout.accum), range(self.iters),
                              tokens_of=lambda _: 1, should_stop=self.stop.should_stop if self.stop else None)
        return None if score is None else score.loss
