"""The DeepSpeed engine's one record in the engine registry (``megafixed.engines``), and its part
of the run plan. Light: it imports neither DeepSpeed nor megatron-core (its hooks are module paths,
imported when called), so ``megafixed plan``, ``--help`` and ``--dry-run`` stay fast."""
from __future__ import annotations

from dataclasses import dataclass

from ...engines import EngineKind, register

NAME = "deepspeed"
_PKG = "megafixed.engine.deepspeed"


@dataclass(frozen=True)
class DeepSpeedPlan:
    """The DeepSpeed engine's part of a ``RunPlan`` (``plan.engine_plan``; read as ``plan.zero_stage``)."""
    zero_stage: int  # zero.stage


def make_plan(cfg) -> DeepSpeedPlan:
    return DeepSpeedPlan(zero_stage=cfg.zero.stage)


# ---- how it describes itself (the `describe` hook is this module)
def start_words(plan) -> str:
    """What shards the state, for the trainer's start line."""
    return f"zero {plan.zero_stage}"


def dry_run_words(plan, record: dict) -> str:
    return f"zero {plan.zero_stage}"


def config_title() -> str:
    return NAME


def record_layout(plan) -> dict:
    """Its keys in a run record's layout."""
    return {"zero_stage": plan.zero_stage}


def layout_change_keys(plan, recorded: dict) -> list:
    """The layout keys whose change means a re-layout: the DP size counts only when a side
    partitions the optimizer (ZeRO >= 1), and a change means a universal resume."""
    partitioned = max(plan.zero_stage, recorded.get("zero_stage", 0)) >= 1
    return ["tp", "pp", "zero_stage", "precision"] + (["dp"] if partitioned else [])


def _groups(plan) -> dict:
    from .groups import megatron_groups

    return megatron_groups(plan)


def _build(cfg, topo):
    from .build import build

    return build(cfg, topo, topo.plan.batch, topo.plan.precision)


def _engine_config(cfg, plan) -> dict:
    """DeepSpeed's JSON, for the machine the plan is for (a dry run on a CPU login node plans a GPU run)."""
    from .config import deepspeed_config

    return deepspeed_config(cfg, plan.batch, plan.precision, gpu=plan.on_gpu)


KIND = register(EngineKind(
    name=NAME, summary="DeepSpeed: ZeRO 0-3, its pipeline engine, megatron-core TP layers (the default)",
    record_file="ds_config.json", config_section="zero", planned_keys=("zero.stage",), default=True,
    make_plan=make_plan,
    check_supported=f"{_PKG}.support:check_supported",
    relayout_refusal=f"{_PKG}.universal:unsupported",
    setup_groups=_groups,
    build=_build,
    engine_config=_engine_config,
    checkpoint=f"{_PKG}.checkpoint_format",
    describe=f"{_PKG}.kind",
    planner=f"{_PKG}.planner",
    prepare_runtime_env=f"{_PKG}.env:prepare_runtime_env",
    stage_bounds=f"{_PKG}.pipeline:partition",
    extra={"accelerator_name": f"{_PKG}.env:accelerator_name"},  # the one DeepSpeed picked at import
))
