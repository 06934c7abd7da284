"""One optimizer step and one validation pass of a pipeline-parallel torch-engine run.

The step hands the library's schedule this rank's ``accum`` micro batches as one batch (the
schedule splits it back into the same micro batches): the first stage gets the token ids, the last
the labels, and ``losses`` collects each microbatch's scaled loss on the last stage. The reported
loss is their sum (the step's per-token mean), averaged over DP with the non-finite flag in one
all-reduce over the whole job (``pipeline.pp_loss_mean``); the gradient norm is step.py's one
all-reduce too (``pipeline.pp_grad_norm``), and clipping, the learning rate and AdamW are step.py's.

Validation does not use the schedule: the library's schedules fix their microbatch count (and 1F1B
needs at least one per stage), while ``train.eval_iters`` is any number. Each evaluation micro
batch is run forward through the stages in order, the activations sent point to point to the rank
of the next stage (``dist.send``/``recv``, shapes known from the plan) -- the forward-only pipeline
every schedule reduces to, without overlap, which is all a validation pass needs.
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

    def __init__(self, parts, stages, ids, schedule, optimizer, *, cfg, topo):
        super().__init__(parts, optimizer, cfg=cfg, topo=topo)
        self.stages, self.ids, self.schedule = stages, ids, schedule
        self.checkpoints.every_rank_reads = True  # train.init_from: each stage keeps its own weights
        self.pp_group = topo.mesh["pp"].get_group()
        self.n_stages = topo.plan.pp * cfg.parallel.vpp
        from .schedules import is_v_shaped, stage_ids

        v = is_v_shaped(cfg.parallel.pp_schedule)
        self.owner = {s: r for r in range(topo.plan.pp) for s in stage_ids(r, topo.plan.pp, cfg.parallel.vpp, v)}

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
        return split_tokens(tokens, self.device, self.cfg.model.vocab_size)

    def train_step(self, batches: Iterator[torch.Tensor], lr: float, step: int) -> StepResult:
        self.model.train()
        inputs, labels = self._local_batch(batches, self.plan.batch.accum)
        losses: list = [] if self.has_last else None
        from ..loops import faults_in_loss_fn

        with self._loss_context(self.model), self._compute()(), \
                faults_in_loss_fn(self.schedule, "_loss_fn", getattr(self, "faults", None), step):
            self.schedule.step(*((inputs,) if self.has_first else ()), target=labels if self.has_last else None,
                               losses=losses, return_outputs=False)
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        if losses:
            local += torch.stack([loss.detach().double() for loss in losses]).sum()
        from .pipeline import pp_grad_norm, pp_loss_mean

        value, nonfinite = pp_loss_mean(local, self.topo)  # one all-reduce over the job: the same bits everywhere
        from .step import apply_update

        return apply_update(self.optimizer, value, nonfinite, lr=lr, grad_clip=self.cfg.optimizer.grad_clip,
                            on_nonfinite=self.cfg.train.on_nonfinite, step=step,
                            norm=lambda params: pp_grad_norm(params, self.pp_group),
                            guard=getattr(self, "guard", None))  # the bad-step guard, before the update

    @torch.no_grad()
    def eval_loss(self, batches: Iterator[torch.Tensor], micro_batches: int) -> float:
        if micro_batches < 1:
            return float("nan")
        from .pipeline import _activation_meta

        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        by_id = dict(zip(self.ids, self.stages))
        loss_fn = self.schedule._loss_fn  # the step's scaling: undone below per micro batch
        scale = self.plan.batch.accum
        try:
            for _ in range(micro_batches):
                inputs, labels = self._local_batch(batches, 1)
                x = inputs
                for s in range(self.n_stages):
                    if s not in by_id:
                        continue
                    stage = by_id[s]
                    if s > 0 and self.owner[s - 1] != self.topo.pp_rank:
                        x = torch.empty_like(_activation_meta(self.cfg, self.plan, stage.span, output=False),
                                             device=self.device)
                        dist.recv(x, group=self.pp_group, group_src=self.owner[s - 1])
                    with self._loss_context(self.model), self._compute()():
                        x = stage(x)
                        if s == self.n_stages - 1:
                            total += loss_fn(x, labels).double() * scale
                    if s < self.n_stages - 1 and self.owner[s + 1] != self.topo.pp_rank:
                        dist.send(x.contiguous(), group=self.pp_group, group_dst=self.owner[s + 1])
        finally:
            self.model.train(was_training)
            _reshard(self.stages)
        dist.all_reduce(total, group=self.pp_group)
        return dp_mean(total / micro_batches, self.topo.dp_group, self.topo.dp)


def _reshard(stages) -> None:
    """FSDP2 roots keep their parameters gathered after a forward under PP (no reshard after
    forward): free them, so a checkpoint's state dict reads the sharded parameters."""
    from torch.distributed.fsdp import FSDPModule

    for stage in stages:
        if isinstance(stage, FSDPModule):
            stage.reshard()


def build_pipeline_engine(cfg, topo) -> PipelineEngine:
    from ...run.optim import build_optimizer
    from .pipeline import build_schedule, build_stages

    parts, stages, ids = build_stages(cfg, topo)
    schedule = build_schedule(cfg, topo, parts, stages, ids)
    optimizer = build_optimizer(parts, cfg.optimizer)
    return PipelineEngine(parts, stages, ids, schedule, optimizer, cfg=cfg, topo=topo)

