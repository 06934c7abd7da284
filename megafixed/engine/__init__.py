"""The engine seam: the one package that knows a training engine (today DeepSpeed).

Everything the rest of megafixed needs from an engine goes through here or through the
``Engine`` protocol (``base.py``): build one for this rank, ask whether a checkpoint can be read
on another layout, read a checkpoint's weights into a plain state dict, write one for a layout,
prepare the process environment, the accelerator's name. Only ``megafixed/engine/`` imports
``deepspeed`` (``tests/test_import_rules.py`` holds that); the implementation is
``megafixed/engine/deepspeed/``, and an FSDP2/DTensor engine will sit beside it.

This module imports no engine library at import time (``megafixed plan`` and the CLI's cheap
checks import it); each function imports its implementation when called.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .base import ConvertError, Engine, NonFiniteLossError, StepResult  # noqa: F401  (the seam's types)
from .batches import TokenRangeError, split_tokens  # noqa: F401

ENGINES = ("deepspeed",)



def check_supported(cfg, plan) -> None:
    """Refuse, by name, what the plan's engine cannot run (called once, by ``RunPlan.build``)."""
    from .deepspeed.support import check_supported as check

    check(cfg, plan.dims.pp)


def build_engine(cfg, topo) -> Engine:
    """This rank's engine for the run: the model config, optimizer and engine keys from ``cfg``;
    the batch, precision and layout from the run plan the topology was made from (``topo.plan``)."""
    from .deepspeed.build import build

    return build(cfg, topo, topo.plan.batch, topo.plan.precision)


def engine_config(cfg, plan) -> dict:
    """The engine's own config for a run (DeepSpeed's JSON; ``<run_dir>/ds_config.json``), for the
    machine the plan is for (a dry run on a CPU login node plans a GPU run)."""
    from .deepspeed.config import deepspeed_config

    return deepspeed_config(cfg, plan.batch, plan.precision, gpu=plan.on_gpu)


def relayout_refusal(old: dict, new: dict) -> Optional[str]:
    """Why a checkpoint of layout ``old`` cannot be loaded on layout ``new`` (run-record layouts:
    tp, pp, dp, zero_stage, precision), or None when the engine can re-layout it on load."""
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


def read_state_dict(tag_dir: Path, *, verify: bool = True) -> dict:
    """The full plain-GPT state dict of a checkpoint of any layout (TP, PP, ZeRO 0-3)."""
    from .deepspeed.convert import gather_state_dict, is_zero3, read_zero3_state_dict

    tag_dir = Path(tag_dir)
    if is_zero3(tag_dir):
        return read_zero3_state_dict(tag_dir)
    return gather_state_dict(tag_dir, verify=verify)


def is_model_file(name: str) -> bool:
    """A checkpoint file that holds weights (what a weights-only reader verifies)."""
    from .deepspeed.convert import MODEL_FILE_RE

    return bool(MODEL_FILE_RE.match(name))


def weights_in_every_rank_file(tag_dir: Path) -> bool:
    """The checkpoint keeps its weights in every rank's partition files (ZeRO-3), not its model files."""
    from .deepspeed.convert import is_zero3

    return is_zero3(Path(tag_dir))


def stage_bounds(weights: list, parts: int, method: str) -> list[int]:
    """Layer boundaries of ``parts`` pipeline stages, by the engine's own partitioner (so a plan
    matches the real split): ``method`` "uniform" or "balanced" (over ``weights``)."""
    from .deepspeed.pipeline import partition

    return partition(weights, parts, method)
