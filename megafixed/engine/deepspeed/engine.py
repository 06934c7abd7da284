"""``DeepSpeedEngine``: the engine seam (``megafixed.engine.base.Engine``) over a DeepSpeed engine.

Every DeepSpeed mechanic stays behind it: the plain/pipeline dispatch (``step.py``), the
non-finite skip flag and ZeRO stage checks, the checkpoint engine that writes its shard files
(``async_save.CheckpointWriter``), ``save_checkpoint``/``load_checkpoint`` and their error
messages, the universal-checkpoint re-layout (``universal.py``) and the module-only load of
initial weights (``convert.write_checkpoint`` for this layout).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from ...run.run_dir import CheckpointError
from ..base import StepHook, StepResult
from ..common import corrupt_checkpoint_error, misfit_checkpoint_error, one_line
from . import step as ds_step


def hp_grad(p: torch.Tensor):
    """The gradient at the accumulation boundary: DeepSpeed's BF16 optimizer moves each micro
    batch's gradient into an fp32 ``_hp_grad`` accumulator and frees ``p.grad``."""
    hp = getattr(p, "_hp_grad", None)
    return hp if hp is not None else p.grad


class DeepSpeedEngine:
    """One rank's DeepSpeed engine (plain or pipeline) behind the engine seam."""

    name = "deepspeed"  # its train.engine value (logs and tests ask; the seam itself does not)
    hook: Optional[StepHook] = None  # what its step asks besides its batches (none, unless build_engine was given one)

    def __init__(self, ds_engine, optimizer, *, cfg, topo, layout, grad_sync=None, hook: Optional[StepHook] = None):
        self.ds = ds_engine  # deepspeed.DeepSpeedEngine or PipelineEngine
        self.hook = hook
        if ds_step.is_pipeline_engine(ds_engine):  # its schedule calls the module's loss function itself
            from ..loops import StepLoss

            ds_engine.module.loss_fn = StepLoss(ds_engine.module.loss_fn, hook)
        self.optimizer = optimizer
        self.cfg, self.topo, self.layout = cfg, topo, layout
        self.grad_sync = grad_sync  # TPGradSync the step finishes at the boundary (plain engine, SP, ZeRO 0/1)
        self.writer = self._install_writer(bool(cfg.checkpoint.async_save))
        self._universal_info: Optional[dict] = None

    # ---- the model
    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    @property
    def device(self) -> torch.device:
        return self.ds.device

    # ---- steps
    def train_step(self, batches: Iterator[torch.Tensor], lr: float, step: int) -> StepResult:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # The loss mean over the whole job in one all-reduce (TP peers add equal copies; a pipeline engine
        # aggregates its own): every rank holds the same bits for the bad-step guard.
        return ds_step.train_step(self.ds, self.optimizer, batches, self.layout.accum, dp=self.topo.world_size,
                                  dp_group=None, on_nonfinite=self.cfg.guard.on_nonfinite,
                                  step=step, grad_sync=self.grad_sync, vocab_size=self.cfg.model.vocab_size,
                                  hook=self.hook, shard=(self.topo.cp_rank, self.topo.cp))

    def eval_loss(self, batches: Iterator[torch.Tensor], micro_batches: int) -> float:
        group, size = self.topo.loss_group  # dp, or dp x cp: each context-parallel rank holds its tokens' mean
        return ds_step.eval_loss(self.ds, batches, micro_batches, dp=size, dp_group=group,
                                 vocab_size=self.cfg.model.vocab_size, shard=(self.topo.cp_rank, self.topo.cp))

    # ---- checkpoint files
    def _install_writer(self, async_save: bool):
        """Our ``CheckpointWriter`` as the engine's ``checkpoint_engine`` (DeepSpeed's seam for how its
        shard files are written): checksums as written, optionally in the background."""
        from .async_save import CheckpointWriter

        writer = CheckpointWriter(async_save, getattr(self.ds, "_config", None))
        self.ds.checkpoint_engine = writer
        return writer

    @property
    def saved_bytes(self) -> int:
        return self.writer.handed_bytes

    def save(self, tag_dir: Path, client_state: dict, *, on_written, on_failed) -> bool:
        from .universal import client_state as universal_client_state

        tag_dir = Path(tag_dir)
        self.writer.begin()
        if self._universal_info is None:
            self._universal_info = universal_client_state(self.cfg.model, self.topo.pp)
        # universal_checkpoint_info: how each parameter is split, so ds_to_universal can re-layout it
        client_state = {**client_state, **self._universal_info}
        self.ds.save_checkpoint(str(tag_dir.parent), tag=tag_dir.name, client_state=client_state,
                                save_latest=False)
        self.writer.finish(on_written, on_failed=lambda exc: on_failed(exc, True))
        return self.writer.async_save

    def wait_for_saves(self) -> None:
        self.writer.wait()

    def load(self, tag_dir: Path, *, relayout: bool = False) -> dict:
        tag_dir = Path(tag_dir)
        if relayout:
            from .universal import UNIVERSAL_DIR, prepare

            prepare(tag_dir, self.cfg.model, self.topo.is_main)
            # DeepSpeed reads this flag only while loading: its load path then takes the universal
            # folder's per-parameter files and slices them for this layout.
            self.ds._config.load_universal_checkpoint = True
            load_dir, load_tag = tag_dir, UNIVERSAL_DIR
        else:
            load_dir, load_tag = tag_dir.parent, tag_dir.name
        return load_files(self.ds, tag_dir, load_dir, load_tag)

    def load_weights(self, read_state_dict: Callable[[], dict], scratch: Path) -> None:
        from .init_weights import load_module_only

        load_module_only(self, read_state_dict, Path(scratch))


def load_files(ds_engine, tag_dir: Path, load_dir: Path, load_tag: str) -> dict:
    """``ds_engine.load_checkpoint`` of ``load_dir/load_tag`` (model, optimizer; not DeepSpeed's LR
    scheduler: ours is a pure function of the step), its errors said in one line about ``tag_dir``."""
    try:
        path, client = ds_engine.load_checkpoint(str(load_dir), tag=load_tag, load_optimizer_states=True,
                                                 load_lr_scheduler_states=False)
    except (RuntimeError, OSError) as exc:
        raise _load_error(exc, tag_dir) from (None if "fixed code mismatch" in str(exc) else exc)
    if path is None:
        raise CheckpointError(f"DeepSpeed found no loadable checkpoint in {tag_dir}")
    return client


def _load_error(exc: BaseException, tag_dir: Path) -> CheckpointError:
    msg = str(exc)
    if isinstance(exc, OSError) or "PytorchStreamReader" in msg:  # a missing or truncated file, not a model change
        return corrupt_checkpoint_error(tag_dir, one_line(msg, keep=1))
    if "fixed code mismatch" in msg:
        lines = [ln.strip() for ln in msg.splitlines() if "fixed code mismatch" in ln]
        return CheckpointError(f"cannot resume from {tag_dir}: " + "; ".join(lines))
    return misfit_checkpoint_error(tag_dir, "DeepSpeed", one_line(msg))
