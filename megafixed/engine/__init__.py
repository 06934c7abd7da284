"""The engine seam: what the rest of megafixed asks of a training engine, looked up in the engine
registry (``megafixed.engines``), never by testing its name.

Everything the trainer, the commands and the readers need from an engine goes through here or
through the ``Engine`` protocol (``base.py``): build one for this rank, ask whether a checkpoint can
be read on another layout and which of its files hold weights, prepare the process environment
(reading a checkpoint's weights into a plain state dict is ``weights.gather_state_dict``). Each
function finds the engine by the plan's ``engine`` (a run-record layout without one was written by
the default engine, DeepSpeed) or, for checkpoints, by asking each registered engine's checkpoint
detector. The implementations are ``megafixed/engine/deepspeed/`` (the default; the only package
that imports DeepSpeed and megatron-core, ``tests/test_import_rules.py``) and
``megafixed/engine/native/`` (FSDP2, DTensor TP, DCP; ``train.engine=torch``), each registered as
one class in its ``kind.py``.

This module imports no engine library at import time (``megafixed plan`` and the CLI's cheap
checks import it); each engine method imports its implementation when called.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from ..engines import checkpoint_kind, engine_kind, kind_of, kinds
from .base import ConvertError, Engine, NonFiniteLossError, StepHook, StepResult  # noqa: F401  (the seam's types)
from .batches import TokenRangeError, split_tokens  # noqa: F401


def build_engine(cfg, topo, hook: Optional[StepHook] = None) -> Engine:
    """This rank's engine for the run: the model config, optimizer and engine keys from ``cfg``;
    the batch, precision and layout from the run plan the topology was made from (``topo.plan``);
    ``hook``: what its step asks besides its batches (kept by the engine: a verdict before the update, each
    micro batch's loss on its way to its backward; None: nothing, as for a benchmark)."""
    return kind_of(topo.plan).build(cfg, topo, hook)


def engine_config(cfg, plan) -> dict:
    """The engine's own config for a run (written to ``<run_dir>/<its facts.record_file>``), for the
    machine the plan is for (a dry run on a CPU login node plans a GPU run)."""
    return kind_of(plan).engine_config(cfg, plan)


def relayout_refusal(old: dict, new: dict) -> Optional[str]:
    """Why a checkpoint of layout ``old`` cannot be loaded on layout ``new`` (run-record layouts:
    tp, pp, dp, precision, the engine's own keys; "engine", absent = the default engine), or None
    when the engine can re-layout it on load. Across engines, the non-default engine's rule speaks
    (it names the other engine's files, which it does not read)."""
    a, b = kind_of(old), kind_of(new)
    judge = b if a is b or a.facts.default else a
    return judge.relayout(old, new).refusal


def prepare_runtime_env(engine: Optional[str] = None, backend: Optional[str] = None) -> None:
    """Call before anything imports the engine's library (DeepSpeed picks its accelerator at
    import); it checks the library's versions. ``engine`` None: the default engine (the commands
    that convert, evaluate or plan use its library); ``backend``: a training run's ``parallel.backend``.

    ``backend="gloo"`` computes on CPU even on a GPU host (the plan says device cpu there), so a library
    that picks its accelerator at import must pick the CPU: DeepSpeed would otherwise take
    ``cuda:LOCAL_RANK`` and hand gloo CUDA tensors."""
    if backend == "gloo":
        import os

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    engine_kind(engine).prepare_runtime_env()


def accelerator_name(engine: Optional[str] = None) -> str:
    """The device kind ``engine``'s library picked ("cuda", "cpu", ...; None: the default engine's),
    asked of that engine alone: the torch engine's answer imports nothing of DeepSpeed's."""
    return engine_kind(engine).accelerator_name()


def is_model_file(name: str) -> bool:
    """A checkpoint file that holds weights (what a weights-only reader verifies), of any engine."""
    return any(re.fullmatch(k.facts.model_files, name) for k in kinds())


def weights_in_every_rank_file(tag_dir: Path) -> bool:
    """The checkpoint keeps its weights in every rank's partition files (ZeRO-3; a DCP checkpoint's
    weights are in every rank's shard files too), not in separate model files."""
    return checkpoint_kind(Path(tag_dir)).checkpoint.weights_in_every_rank_file(Path(tag_dir))
