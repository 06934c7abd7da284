"""The engine seam: what the trainer, validation, checkpointing and evaluation ask of an engine,
and nothing else (torchtitan's ``ModelWrapper`` / OLMo-core's ``TrainModule`` are the shape).

An engine owns the model on this rank, its optimizer, the gradient reductions and the shape of
its checkpoint files. It is built from the run's layout and precision (``megafixed.engine.
build_engine``); the trainer then only ever calls the methods below. The checkpoint commit
protocol around ``save``/``load`` (markers, sizes, run record, manifest, ``latest``, rotation,
RNG) is the engine-agnostic ``megafixed.train.checkpoint.Checkpointer``.

Nothing here may name one engine's mechanics (ZeRO stages, skip flags, file names): the
DeepSpeed engine (``megafixed.engine.deepspeed``) and the FSDP2/DTensor one (``megafixed.engine.
native``) implement it, each registered once in ``megafixed.engines`` (its ``kind.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Protocol, runtime_checkable

import torch


@dataclass
class StepVerdict:
    """Why a step's update was dropped: what an engine needs of a verdict, and all it makes itself (a
    non-finite loss under ``guard.on_nonfinite=skip``/``rollback`` with no step hook). The hook's verdicts
    are the guard's (``train.callbacks.guard.verdict.Verdict``: this, with the spike's window and the words)."""
    step: int  # as numbered in the logs
    kind: str  # "nonfinite" or "spike"
    what: str  # "loss" or "grad_norm"
    value: float
    action: str  # stop / skip / rollback


@dataclass
class StepResult:
    loss: float  # mean over the global batch (all data-parallel ranks)
    grad_norm: Optional[float]
    skipped: bool  # a bad step (non-finite or spike) with a guard: the update was dropped
    verdict: Optional[StepVerdict] = None  # the step hook's verdict, if any


class StepHook(Protocol):
    """What an engine's step asks besides its batches: the one hook it is given when it is built
    (``megafixed.engine.build_engine(cfg, topo, hook=...)``, kept by the engine; the trainer's is its
    callbacks, ``train.callbacks.CallbackHooks``). None (a benchmark, a converter): nothing is judged, each
    loss goes to its backward as it is, and a non-finite loss follows ``guard.on_nonfinite`` (``stop`` raises)."""

    def judge(self, step: int, what: str, value: Optional[float]) -> Optional[StepVerdict]:
        """The verdict on the loss (``what="loss"``) or the global gradient norm (``"grad_norm"``) of
        ``step`` -- a value every rank holds identically -- or None when it is good. With a verdict the
        engine drops the update (weights, gradients and optimizer state as before the step) and returns
        the verdict for the trainer to act on."""

    def loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Every micro batch's loss on its way to its backward, as the backward is to see it (a drill's
        factor; the re-check's note of it)."""


class ConvertError(ValueError):
    """A checkpoint whose weights cannot be gathered, or a layout that cannot hold them."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN/Inf and ``guard.on_nonfinite=stop``."""


def nonfinite_message(step: int, value: float) -> str:
    """``step``: numbered as in the logs (the first optimizer step is step 1)."""
    return (f"step {step}: the training loss is {value} (non-finite). The run stops here; the last "
            f"checkpoint is intact. Usual fixes: lower optimizer.lr or raise schedule.warmup_steps, lower "
            f"optimizer.grad_clip, check the data for bad token ids; or set guard.on_nonfinite=skip to drop "
            f"such batches without an update")


# What ``Engine.save`` hands back once this rank's files are on disk: relative path -> {"size", "sha256"}.
FileRecords = dict
OnWritten = Callable[[FileRecords], None]
OnFailed = Callable[[BaseException, bool], BaseException]  # (error, asynchronous) -> the error to raise


@runtime_checkable
class Engine(Protocol):
    """One rank's training engine."""

    module: torch.nn.Module  # this rank's part of the model (a stage under PP, shards under TP)
    device: torch.device

    def train_step(self, batches: Iterator[torch.Tensor], lr: float, step: int) -> StepResult:
        """Optimizer step ``step`` (numbered as in the logs: the first is 1) at learning rate ``lr``
        over this rank's micro batches of one global batch (pulled from ``batches``); the loss is
        averaged over data-parallel ranks. A step with a verdict of ``hook.judge`` leaves weights,
        gradients and optimizer state as they were before it, so the same step may be computed again
        from the same state (the trainer's re-check of a bad step)."""

    def eval_loss(self, batches: Iterator[torch.Tensor], micro_batches: int) -> float:
        """Mean loss over ``micro_batches`` micro batches on this rank, averaged over DP ranks."""

    def save(self, tag_dir: Path, client_state: dict, *, on_written: OnWritten, on_failed: OnFailed) -> bool:
        """Write this rank's engine files (model, optimizer, ``client_state``) into ``tag_dir``;
        call ``on_written(records)`` once they are written and fsynced (maybe from a background
        thread: the engine may save asynchronously). A failure goes through ``on_failed``. Returns
        whether it returned before the files are written (the save goes on in the background)."""

    def wait_for_saves(self) -> None:
        """Block until a save in flight is written (and its ``on_written`` has run); raise its error."""

    @property
    def saved_bytes(self) -> int:
        """Tensor bytes handed to the writer by the current save (a failed save says what it needed)."""

    def load(self, tag_dir: Path, *, relayout: bool = False) -> dict:
        """Restore model and optimizer from ``tag_dir``; return its client state. ``relayout``:
        the checkpoint was written by another layout (its ``EngineKind.relayout`` said it can be read)."""

    def load_weights(self, read_state_dict: Callable[[], dict], scratch: Path) -> None:
        """Set the model's weights (only) from a full plain-GPT state dict; ``read_state_dict`` is
        called on the ranks that need it; ``scratch`` is a folder the engine may use and delete."""
