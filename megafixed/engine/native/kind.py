"""The torch engine's one record in the engine registry (``megafixed.engines``), and its part of
the run plan. Light: its hooks are module paths, imported when called (DCP, FSDP2 only then)."""
from __future__ import annotations

from dataclasses import dataclass

from ...engines import EngineKind, register

NAME = "torch"
_PKG = "megafixed.engine.native"


@dataclass(frozen=True)
class TorchPlan:
    """The torch engine's part of a ``RunPlan`` (``plan.engine_plan``; read as ``plan.dp_replicate``)."""
    dp_replicate: int  # torch_engine.dp_replicate: HSDP's replicate degree (1 = FSDP over all of dp)
    reshard_after_forward: bool  # torch_engine.reshard_after_forward


def make_plan(cfg) -> TorchPlan:
    t = cfg.torch_engine
    return TorchPlan(dp_replicate=t.dp_replicate, reshard_after_forward=t.reshard_after_forward)


# ---- how it describes itself (the `describe` hook is this module)
def start_words(plan) -> str:
    """``torch engine, FSDP2 over dp 2`` / ``HSDP 2 x 2``: what shards the state."""
    replicate = plan.dp_replicate
    if plan.dp == 1:
        return "torch engine"
    if replicate == 1:
        return f"torch engine, FSDP2 over dp {plan.dp}"
    return f"torch engine, HSDP {replicate} x {plan.dp // replicate}"


def dry_run_words(plan, record: dict) -> str:
    d = record["data_parallel"]
    return f"engine torch, {d['mode']} (dp_replicate {d['replicate_degree']} x dp_shard {d['shard_degree']})"


def config_title() -> str:
    return f"{NAME} engine"


def record_layout(plan) -> dict:
    """None of its own keys: it does not read ``zero.*`` (FSDP2 shards by the DP degree), so a record
    of it must not claim a stage."""
    return {}


def layout_change_keys(plan, recorded: dict) -> list:
    """FSDP2 shards parameters and optimizer state over the DP ranks, so every DP/TP change is a
    re-layout, which DCP's resharding does on load."""
    return ["tp", "pp", "dp", "precision"]


def _groups(plan) -> dict:
    """One DeviceMesh in the plan's rank order, and its groups (no megatron-core on this path)."""
    from .mesh import build_mesh, dp_submesh

    mesh = build_mesh(plan, plan.dp_replicate)
    tp_group = mesh["tp"].get_group()
    return dict(mesh=mesh, tp_group=tp_group, dp_group=dp_submesh(mesh).get_group(), model_parallel_group=tp_group)


def _prepare_runtime_env() -> None:
    """Nothing to set before torch: it has no accelerator to pick at import, and no library outside
    torch whose version to check (DeepSpeed's check is DeepSpeed's)."""


KIND = register(EngineKind(
    name=NAME, summary="torch-native: FSDP2/HSDP, DTensor TP/SP, torch.distributed.checkpoint",
    record_file="torch_engine.json", config_section="torch_engine",
    planned_keys=("torch_engine.dp_replicate", "torch_engine.reshard_after_forward"),
    make_plan=make_plan,
    check_supported=f"{_PKG}.support:check_supported",
    relayout_refusal=f"{_PKG}.checkpoint:relayout_refusal",
    setup_groups=_groups,
    build=f"{_PKG}.build:build",
    engine_config=f"{_PKG}.config:engine_config",
    checkpoint=f"{_PKG}.checkpoint_format",
    describe=f"{_PKG}.kind",
    planner=f"{_PKG}.planner",
    prepare_runtime_env=_prepare_runtime_env,
))
