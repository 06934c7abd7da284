"""The engine seam: what the rest of megafixed asks of a training engine, looked up in the engine
registry (``megafixed.engines``), never by testing its name.

Everything the trainer, the commands and the readers need from an engine goes through here or
through the ``Engine`` protocol (``base.py``): build one for this rank, ask whether a checkpoint can
be read on another layout, read a checkpoint's weights into a plain state dict, prepare the process
environment. Each function finds the engine by the plan's ``engine`` (a run-record layout without
one was written by the default engine, DeepSpeed) or, for the readers, by asking each registered
engine's checkpoint detector. The implementations are ``megafixed/engine/deepspeed/`` (the
default; the only package that imports DeepSpeed and megatron-core, ``tests/test_import_rules.py``)
and ``megafixed/engine/native/`` (FSDP2, DTensor TP, DCP; ``train.engine=torch``), each with its
one registry record in its ``kind.py``.

This module imports no engine library at import time (``megafixed plan`` and the CLI's cheap
checks import it); each hook imports its implementation when called.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..engines import checkpoint_kind, engine_kind, kind_of, kinds
from .base import ConvertError, Engine, NonFiniteLossError, StepResult  # noqa: F401  (the seam's types)
from .batches import TokenRangeError, split_tokens  # noqa: F401


def check_supported(cfg, plan) -> None:
    """Refuse, by name, what the plan's engine cannot run (called once, by ``RunPlan.build``)."""
    kind_of(plan).call("check_supported", cfg, plan)


def build_engine(cfg, topo) -> Engine:
    """This rank's engine for the run: the model config, optimizer and engine keys from ``cfg``;
    the batch, precision and layout from the run plan the topology was made from (``topo.plan``)."""
    return kind_of(topo.plan).call("build", cfg, topo)


def engine_config(cfg, plan) -> dict:
    """The engine's own config for a run (written to ``<run_dir>/<its record_file>``), for the
    machine the plan is for (a dry run on a CPU login node plans a GPU run)."""
    return kind_of(plan).call("engine_config", cfg, plan)


def relayout_refusal(old: dict, new: dict) -> Optional[str]:
    """Why a checkpoint of layout ``old`` cannot be loaded on layout ``new`` (run-record layouts:
    tp, pp, dp, precision, the engine's own keys; "engine", absent = the default engine), or None
    when the engine can re-layout it on load. Across engines, the non-default engine's rule speaks
    (it names the other engine's files, which it does not read)."""
    a, b = kind_of(old), kind_of(new)
    judge = b if a is b or a.default else a
    return judge.call("relayout_refusal", old, new)


def prepare_runtime_env(engine: Optional[str] = None) -> None:
    """Call before anything imports the engine's library (DeepSpeed picks its accelerator at
    import); it checks the library's versions. ``engine`` None: the default engine (the commands
    that convert, evaluate or plan use its library)."""
    kind = engine_kind(engine)
    if kind.prepare_runtime_env is not None:
        kind.call("prepare_runtime_env")


def accelerator_name(engine: Optional[str] = None) -> str:
    """The device kind ``engine``'s library picked ("cuda", "cpu", ...; None: the default engine's),
    asked of that engine alone: the torch engine's answer imports nothing of DeepSpeed's."""
    import importlib

    hook = engine_kind(engine).extra["accelerator_name"]
    if isinstance(hook, str):
        module, _, attr = hook.partition(":")
        hook = getattr(importlib.import_module(module), attr)
    return hook()


def checkpoint_format(tag_dir: Path):
    """The checkpoint-format module of the engine that wrote ``tag_dir``."""
    return checkpoint_kind(Path(tag_dir)).hook("checkpoint")


def read_state_dict(tag_dir: Path, *, verify: bool = True) -> dict:
    """The full plain-GPT state dict of a checkpoint of any layout (TP, PP, ZeRO 0-3; any engine)."""
    return checkpoint_format(tag_dir).read_state_dict(Path(tag_dir), verify=verify)


def is_model_file(name: str) -> bool:
    """A checkpoint file that holds weights (what a weights-only reader verifies), of any engine."""
    return any(k.hook("checkpoint").is_model_file(name) for k in kinds())


def weights_in_every_rank_file(tag_dir: Path) -> bool:
    """The checkpoint keeps its weights in every rank's partition files (ZeRO-3; a DCP checkpoint's
    weights are in every rank's shard files too), not in separate model files."""
    return checkpoint_format(tag_dir).weights_in_every_rank_file(Path(tag_dir))


def stage_bounds(weights: list, parts: int, method: str, engine: Optional[str] = None) -> list[int]:
    """Layer boundaries of ``parts`` pipeline stages, by the engine's own partitioner (so a plan
    matches the real split): ``method`` "uniform" or "balanced" (over ``weights``). An engine
    without a pipeline (the torch engine) never has parts > 1; one part needs no partitioner."""
    kind = engine_kind(engine)
    if kind.stage_bounds is None:
        if parts == 1:
            return [0, len(weights)]
        kind = engine_kind(None)
    return kind.call("stage_bounds", weights, parts, method)
