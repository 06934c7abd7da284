"""The engine seam: the one package that knows a training engine (DeepSpeed, or torch-native).

Everything the rest of megafixed needs from an engine goes through here or through the
``Engine`` protocol (``base.py``): build one for this rank, ask whether a checkpoint can be read
on another layout, read a checkpoint's weights into a plain state dict, write one for a layout,
prepare the process environment, the accelerator's name. Only ``megafixed/engine/`` imports
``deepspeed`` (``tests/test_import_rules.py`` holds that); the implementations are
``megafixed/engine/deepspeed/`` (the default) and ``megafixed/engine/native/`` (FSDP2, DTensor TP,
DCP; ``train.engine=torch``), and each function here dispatches on the plan's engine or, for the
readers, on the checkpoint's format.

This module imports no engine library at import time (``megafixed plan`` and the CLI's cheap
checks import it); each function imports its implementation when called.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .base import ConvertError, Engine, NonFiniteLossError, StepResult  # noqa: F401  (the seam's types)
from .batches import TokenRangeError, split_tokens  # noqa: F401

ENGINES = ("deepspeed", "torch")  # train.engine's values
TORCH = "torch"  # the torch-native engine (megafixed.engine.native)


def _is_torch(plan_or_layout) -> bool:
    """A run plan's engine, or a run-record layout's (a record without "engine" is DeepSpeed's)."""
    if isinstance(plan_or_layout, dict):
        return plan_or_layout.get("engine", "deepspeed") == TORCH
    return getattr(plan_or_layout, "engine", "deepspeed") == TORCH


def check_supported(cfg, plan) -> None:
    """Refuse, by name, what the plan's engine cannot run (called once, by ``RunPlan.build``)."""
    if _is_torch(plan):
        from .native.support import check_supported as check
    else:
        from .deepspeed.support import check_supported as check
    check(cfg, plan)


def build_engine(cfg, topo) -> Engine:
    """This rank's engine for the run: the model config, optimizer and engine keys from ``cfg``;
    the batch, precision and layout from the run plan the topology was made from (``topo.plan``)."""
    if _is_torch(topo.plan):
        from .native.build import build as build_native

        return build_native(cfg, topo)
    from .deepspeed.build import build

    return build(cfg, topo, topo.plan.batch, topo.plan.precision)


def engine_config(cfg, plan) -> dict:
    """The engine's own config for a run (DeepSpeed's JSON, ``<run_dir>/ds_config.json``; the torch
    engine's mesh/FSDP/precision record), for the machine the plan is for (a dry run on a CPU login
    node plans a GPU run)."""
    if _is_torch(plan):
        from .native.config import engine_config as native_config

        return native_config(cfg, plan)
    from .deepspeed.config import deepspeed_config

    return deepspeed_config(cfg, plan.batch, plan.precision, gpu=plan.on_gpu)


def relayout_refusal(old: dict, new: dict) -> Optional[str]:
    """Why a checkpoint of layout ``old`` cannot be loaded on layout ``new`` (run-record layouts:
    tp, pp, dp, zero_stage, precision; "engine", absent = deepspeed), or None when the engine can
    re-layout it on load."""
    if _is_torch(old) or _is_torch(new):
        # The torch engine's rule (DCP reshards), including the refusal of the other engine's files.
        from .native.checkpoint import relayout_refusal as native_refusal

        return native_refusal(old, new)
    from .deepspeed.universal import unsupported

    return unsupported(old, new)


def prepare_runtime_env() -> None:
    """Call before anything imports the engine library (it picks its accelerator at import)."""
    from .deepspeed.env import prepare_runtime_env as prepare

    prepare()


def accelerator_name() -> str:
    """The device kind the engine library picked ("cuda", "cpu", ...)."""
    from .deepspeed.env import accelerator_name as name

    return name()


def _native_checkpoint():
    """The torch engine's checkpoint module (imported only when a reader asks: it imports DCP)."""
    from .native import checkpoint

    return checkpoint


def is_native_checkpoint(tag_dir: Path) -> bool:
    """A checkpoint tag written by the torch engine (DCP), not by DeepSpeed."""
    return _native_checkpoint().is_native_checkpoint(Path(tag_dir))


def read_state_dict(tag_dir: Path, *, verify: bool = True) -> dict:
    """The full plain-GPT state dict of a checkpoint of any layout (TP, PP, ZeRO 0-3; either engine)."""
    tag_dir = Path(tag_dir)
    if is_native_checkpoint(tag_dir):
        from .native.reader import read_state_dict as read_native

        return read_native(tag_dir, verify=verify)
    from .deepspeed.convert import gather_state_dict, is_zero3, read_zero3_state_dict

    if is_zero3(tag_dir):
        return read_zero3_state_dict(tag_dir)
    return gather_state_dict(tag_dir, verify=verify)


def is_model_file(name: str) -> bool:
    """A checkpoint file that holds weights (what a weights-only reader verifies), of either engine."""
    from .deepspeed.convert import MODEL_FILE_RE

    return bool(MODEL_FILE_RE.match(name)) or _native_checkpoint().is_model_file(name)


def weights_in_every_rank_file(tag_dir: Path) -> bool:
    """The checkpoint keeps its weights in every rank's partition files (ZeRO-3; a DCP checkpoint's
    weights are in every rank's shard files too), not in separate model files."""
    if is_native_checkpoint(tag_dir):
        return _native_checkpoint().weights_in_every_rank_file(Path(tag_dir))
    from .deepspeed.convert import is_zero3

    return is_zero3(Path(tag_dir))


def stage_bounds(weights: list, parts: int, method: str) -> list[int]:
    """Layer boundaries of ``parts`` pipeline stages, by the engine's own partitioner (so a plan
    matches the real split): ``method`` "uniform" or "balanced" (over ``weights``)."""
    from .deepspeed.pipeline import partition

    return partition(weights, parts, method)
