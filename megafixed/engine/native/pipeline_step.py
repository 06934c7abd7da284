"""One optimizer step and one validation pass of a pipeline-parallel torch-engine run.

The step hands the library's schedule this rank's ``accum`` micro batches as one batch (the
schedule splits it back into the same micro batches): the first stage gets the token ids, the last
the labels, and ``losses`` collects each microbatch's scaled loss on the last stage. The reported
loss is their sum (the step's per-token mean), averaged over DP with the non-finite flag in one
all-reduce over the whole job (``pipeline.pp_loss_mean``); the gradient norm is step.py's one
all-reduce too (``pipeline.pp_grad_norm``), and clipping, the learning rate and AdamW are step.py's.

Validation is a schedule's own forward-only pass (``schedule.eval``, as torchtitan's validator
runs it) with each microbatch's loss over all of the pass's tokens, so that the losses add up to the
pass's mean. A schedule fixes its microbatch count when it is built, while ``eval_loss`` takes any
number: the training schedule serves a pass of ``accum`` micro batches (the trainer's), and any
other count gets an evaluation schedule of its own, built once, over the same stage modules
(``pipeline.build_schedule(forward_only=True)``: a class that takes any count, on the same
stage-to-rank map). A V-shaped layout always takes the latter: torch 2.13 cannot run its training
schedules forward-only (``pipeline._keep_forward_actions``). An evaluation schedule's stages keep their
receive buffers (one activation per microbatch, as the training schedule's do) between passes.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from ..base import StepResult
from ..batches import dp_mean, split_tokens
from .engine import NativeEngine


class PipelineEngine(NativeEngine):
    """``NativeEngine`` whose model is this rank's pipeline stages (``pipeline.PipelineParts``)."""

    def __init__(self, parts, stages, ids, optimizer, *, cfg, topo, hook=None):
        super().__init__(parts, optimizer, cfg=cfg, topo=topo, hook=hook)
        self.stages, self.ids = stages, ids
        self.checkpoints.every_rank_reads = True  # train.init_from: each stage keeps its own weights
        self.pp_group = topo.mesh["pp"].get_group()
        self.n_stages = self.plan.pp * self.plan.engine_plan.vpp
        self._tp_mesh = topo.mesh["tp"] if self.plan.tp > 1 else None
        accum = self.plan.batch.accum
        # The loss the training schedule calls for each microbatch on the last stage: through the step hook
        # while a training step is in flight (loops.StepLoss).
        from ..loops import StepLoss

        self.loss_fn = StepLoss(self._microbatch_loss(accum), self.hook)
        self.schedule = self._schedule(accum, lambda output, target: self.loss_fn(output, target))
        self._eval_schedules: dict = {}  # microbatch count -> its evaluation schedule (not accum's)

    def _microbatch_loss(self, n_microbatches: int):
        from .pipeline import microbatch_loss

        return microbatch_loss(self.model, self.plan, self._tp_mesh, n_microbatches)

    def _schedule(self, n_microbatches: int, loss_fn, **kwargs):
        from .pipeline import build_schedule

        return build_schedule(self.cfg, self.topo, self.stages, self.ids, n_microbatches, loss_fn, **kwargs)

    @property
    def has_first(self) -> bool:
        return 0 in self.ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.ids

    def _compute(self):
        from .step import compute_context

        return compute_context(self.stages[0], self.plan.precision, self.device)

    def _local_batch(self, batches: Iterator[torch.Tensor], n: int):
        tokens = torch.cat([next(batches) for _ in range(n)])
        return split_tokens(tokens, self.device, self.cfg.model.vocab_size, shard=self.shard)

    def train_step(self, batches: Iterator[torch.Tensor], lr: float, step: int) -> StepResult:
        self.model.train()
        inputs, labels = self._local_batch(batches, self.plan.batch.accum)
        losses: list = [] if self.has_last else None
        with self._batch_context(self.model, inputs, labels) as batch, self._loss_context(self.model), \
                self._compute()(), self.loss_fn.during(step):
            self.schedule.step(*((batch.inputs,) if self.has_first else ()),
                               target=batch.labels if self.has_last else None, losses=losses, return_outputs=False)
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        if losses:
            local += torch.stack([loss.detach().double() for loss in losses]).sum()
        from .pipeline import pp_grad_norm, pp_loss_mean

        value, nonfinite = pp_loss_mean(local, self.topo)  # one all-reduce over the job: the same bits everywhere
        from .step import apply_update

        return apply_update(self.optimizer, value, nonfinite, lr=lr, grad_clip=self.cfg.optimizer.grad_clip,
                            on_nonfinite=self.cfg.guard.on_nonfinite, step=step,
                            norm=lambda params: pp_grad_norm(params, self.pp_group),
                            hook=self.hook)  # the verdict, before the update

    def eval_schedule(self, n_microbatches: int):
        """The schedule a validation pass of ``n_microbatches`` micro batches runs (see the module's doc)."""
        from .schedules import is_v_shaped

        if n_microbatches == self.plan.batch.accum and not is_v_shaped(self.plan.engine_plan.pp_schedule):
            return self.schedule  # its loss: one microbatch's over accum microbatches' tokens, as needed
        if n_microbatches not in self._eval_schedules:
            self._eval_schedules[n_microbatches] = self._schedule(
                n_microbatches, self._microbatch_loss(n_microbatches), forward_only=True)
        return self._eval_schedules[n_microbatches]

    @torch.no_grad()
    def eval_loss(self, batches: Iterator[torch.Tensor], micro_batches: int) -> float:
        if micro_batches < 1:
            return float("nan")
        schedule = self.eval_schedule(micro_batches)
        inputs, labels = self._local_batch(batches, micro_batches)
        losses: list = [] if self.has_last else None
        was_training = self.model.training
        self.model.eval()
        try:
            with self._batch_context(self.model, inputs, labels) as batch, self._loss_context(self.model), \
                    self._compute()():
                schedule.eval(*((batch.inputs,) if self.has_first else ()),
                              target=batch.labels if self.has_last else None, losses=losses)
        finally:
            self.model.train(was_training)
            _reshard(self.stages)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if losses:
            total += torch.stack([loss.double() for loss in losses]).sum()
        dist.all_reduce(total, group=self.pp_group)
        return dp_mean(total, *self.topo.loss_group)  # over dp (x cp)


def _reshard(stages) -> None:
    """FSDP2 roots keep their parameters gathered after a forward under PP (no reshard after
    forward): free them, so a checkpoint's state dict reads the sharded parameters."""
    from torch.distributed.fsdp import FSDPModule

    for stage in stages:
        if isinstance(stage, FSDPModule):
            stage.reshard()


def build_pipeline_engine(cfg, topo, hook=None) -> PipelineEngine:
    from ...run.optim import build_optimizer
    from .pipeline import build_stages

    parts, stages, ids = build_stages(cfg, topo)
    optimizer = build_optimizer(parts, cfg.optimizer)
    return PipelineEngine(parts, stages, ids, optimizer, cfg=cfg, topo=topo, hook=hook)
