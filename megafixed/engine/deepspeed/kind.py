"""The DeepSpeed engine as the engine registry asks it (``megafixed.engine.protocols.EngineKind``), and its
part of the run plan. Light: each method imports DeepSpeed or megatron-core when it is called, so
``megafixed plan``, ``--help`` and ``--dry-run`` stay fast."""
from __future__ import annotations

from dataclasses import dataclass

from ...engines import register
from ..protocols import EngineFacts, Relayout
from . import planner as _planner  # arithmetic only: its table column and notes are this engine's facts
from .file_names import MODEL_FILES


@dataclass(frozen=True)
class DeepSpeedPlan:
    """The DeepSpeed engine's part of a ``RunPlan`` (``plan.engine_plan``)."""
    zero_stage: int  # zero.stage
    start_words: str = ""  # what shards the state, in the trainer's start line ("zero 1")


class DeepSpeedKind:
    """DeepSpeed: ZeRO 0-3, its pipeline engine, megatron-core TP layers (the default)."""

    name = "deepspeed"
    facts = EngineFacts(
        default=True, record_file="ds_config.json", config_title="deepspeed", model_files=MODEL_FILES,
        dry_run_words="zero {zero_optimization[stage]}",  # formatted with its config record
        column=_planner.COLUMN, notes=_planner.NOTES, layout_keys=_planner.LAYOUT_KEYS, fake_worker=None,
        record_keys=("zero_stage",),
        derived_dirs=("universal",))  # universal.UNIVERSAL_DIR: its re-layout copy, made on a layout change

    @property
    def checkpoint(self):
        from . import checkpoint_format

        return checkpoint_format

    @property
    def planner(self):
        from . import planner

        return planner

    def make_plan(self, cfg, dp: int, device: str = "cpu") -> DeepSpeedPlan:
        return DeepSpeedPlan(zero_stage=cfg.zero.stage, start_words=f"zero {cfg.zero.stage}")

    def check_supported(self, cfg, plan) -> None:
        from .support import check_supported

        check_supported(cfg, plan)

    def relayout(self, old: dict, new: dict) -> Relayout:
        """The DP and CP sizes count only when a side partitions the optimizer (ZeRO >= 1: it partitions over
        data x context ranks), and a change means a universal resume, which ``universal.unsupported`` may
        refuse. The weights do not depend on cp."""
        from .universal import unsupported

        partitioned = max(new.get("zero_stage", 0), old.get("zero_stage", 0)) >= 1
        keys = ("tp", "pp", "zero_stage", "precision") + (("dp", "cp") if partitioned else ())
        return Relayout(keys, unsupported(old, new))

    def setup_groups(self, plan) -> dict:
        from .groups import megatron_groups

        return megatron_groups(plan)

    def build(self, cfg, topo, hook=None):
        from .build import build

        return build(cfg, topo, topo.plan.batch, topo.plan.precision, hook)

    def engine_config(self, cfg, plan) -> dict:
        """DeepSpeed's JSON, for the machine the plan is for (a dry run on a CPU login node plans a GPU run)."""
        from .config import deepspeed_config

        return deepspeed_config(cfg, plan.batch, plan.precision, gpu=plan.on_gpu)

    def prepare_runtime_env(self) -> None:
        from .env import prepare_runtime_env

        prepare_runtime_env()

    def accelerator_name(self) -> str:
        """The one DeepSpeed picked at import."""
        from .env import accelerator_name

        return accelerator_name()

    def dry_run_lines(self, cfg, plan) -> list:
        return []


register(DeepSpeedKind())
