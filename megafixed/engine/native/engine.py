"""``NativeEngine``: the engine seam (``megafixed.engine.base.Engine``) over a torch-native model
(FSDP2 / DTensor) and its optimizer. Steps are ``step.py``'s; checkpoint files are
``checkpoint.py``'s (torch.distributed.checkpoint)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from ..base import StepHook, StepResult
from . import step as native_step


class NativeEngine:
    """One rank's torch-native engine behind the engine seam."""
    name = "torch"  # its train.engine value (logs and tests ask; the seam itself does not)
    hook: Optional[StepHook] = None  # what its step asks besides its batches (none, unless build_engine was given one)

    def __init__(self, model: torch.nn.Module, optimizer, *, cfg, topo, hook: Optional[StepHook] = None):
        self.model, self.optimizer, self.cfg, self.topo = model, optimizer, cfg, topo
        self.hook = hook
        self.plan = topo.plan
        self._loss_context = self._pick_loss_context()
        from .ring import batch_context

        self._batch_context = batch_context(topo)  # ring attention's context per micro batch (else the batch)
        from .checkpoint import DcpCheckpoint

        self.checkpoints = DcpCheckpoint(model, optimizer, async_save=bool(cfg.checkpoint.async_save))

    def _pick_loss_context(self) -> Callable:
        if self.plan.tp > 1:
            from .tensor import loss_context  # vocab-parallel loss (loss_parallel) around forward + backward

            return loss_context
        return lambda _model: contextlib.nullcontext()

    # ---- the model
    @property
    def module(self) -> torch.nn.Module:
        return self.model

    @property
    def device(self) -> torch.device:
        return self.topo.device

    # ---- steps
    def train_step(self, batches: Iterator[torch.Tensor], lr: float, step: int) -> StepResult:
        # The loss mean over the whole job in one all-reduce (TP peers add equal copies; CP peers the means
        # of equal slices), not over the DP group of each TP column: every rank holds the same bits for the
        # bad-step guard.
        from .mesh import job_group

        job = job_group(self.topo.mesh) if self.topo.mesh is not None else None
        return native_step.train_step(self.model, self.optimizer, batches, self.plan.batch.accum, lr=lr,
                                      dp=self.topo.world_size, dp_group=job,
                                      grad_clip=self.cfg.optimizer.grad_clip, on_nonfinite=self.cfg.guard.on_nonfinite,
                                      step=step, vocab_size=self.cfg.model.vocab_size, device=self.device,
                                      loss_context=self._loss_context, precision=self.plan.precision,
                                      hook=self.hook, shard=self.shard, batch_context=self._batch_context)

    @property
    def shard(self) -> tuple[int, int]:
        """(cp rank, cp): this rank's context-parallel slice of every sequence ((0, 1): all of it)."""
        if self.topo.cp > 1 and self.plan.cp_method == "ring":
            return 0, 1  # whole sequences: ring_context shards them in torch's load-balanced order
        return self.topo.cp_rank, self.topo.cp

    def eval_loss(self, batches: Iterator[torch.Tensor], micro_batches: int) -> float:
        group, size = self.topo.loss_group  # dp, times cp under context parallelism
        return native_step.eval_loss(self.model, batches, micro_batches, dp=size, dp_group=group,
                                     vocab_size=self.cfg.model.vocab_size, device=self.device,
                                     loss_context=self._loss_context, precision=self.plan.precision,
                                     shard=self.shard, batch_context=self._batch_context)

    # ---- checkpoint files (native/checkpoint.py: DCP)
    def save(self, tag_dir: Path, client_state: dict, *, on_written, on_failed) -> bool:
        self.checkpoints.save(tag_dir, client_state, on_written=on_written, on_failed=on_failed)
        return self.checkpoints.async_save

    def wait_for_saves(self) -> None:
        self.checkpoints.wait()

    @property
    def saved_bytes(self) -> int:
        return self.checkpoints.saved_bytes

    def load(self, tag_dir: Path, *, relayout: bool = False) -> dict:
        client_state = self.checkpoints.load(tag_dir, relayout=relayout)
        self._after_weights_changed()
        return client_state

    def load_weights(self, read_state_dict: Callable[[], dict], scratch: Path) -> None:
        self.checkpoints.load_weights(read_state_dict, scratch)
        self._after_weights_changed()

    def _after_weights_changed(self) -> None:
        """FSDP2's float8 all-gather: the loaded weights' scales, as the optimizer step's hook computes
        them (float8.py), so the next step casts as an uninterrupted run's would."""
        from .float8 import float8_all_gather

        if self.cfg.train.float8 != "off" and self.plan.pp == 1 and float8_all_gather(self.cfg, self.plan):
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.model)
