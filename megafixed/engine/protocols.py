"""The engine seam's roles, one protocol each: what megafixed asks of a registered engine (``EngineKind``),
of its checkpoint files (``CheckpointFormat``) and of its sizing arithmetic (``Planner``). One rank's
running engine is ``base.Engine``. What is said and recorded of an engine (its words, file names, table
column, record keys) is data, ``EngineFacts``, read by engine-neutral code: the protocols hold only what the
trainer, the planner and the checkpoint readers call (``tests/test_engine_seam.py`` counts them). Each
engine implements them in its own package (``kind.py``, ``checkpoint_format.py``, ``planner.py``) and
registers its ``EngineKind`` in ``megafixed.engines``, the name lookup that sits beneath the config (which
validates ``train.engine`` against it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

if TYPE_CHECKING:  # annotations only; all of these sit beneath the engine package
    from ..config import Config
    from ..model.config import ModelConfig
    from ..parallel.memory import Estimate, Layout
    from ..parallel.topology import Topology
    from ..parallel.traffic import Traffic
    from ..run_plan import RunPlan
    from .base import Engine, StepHook


class CheckpointFormat(Protocol):
    """How an engine's checkpoint files are read into a plain GPT state dict (which files are its and which
    hold weights is data, the engine's ``EngineFacts.checkpoint_marker`` and ``.model_files``)."""

    def read_state_dict(self, tag_dir: Path, *, verify: bool = True) -> dict:
        """The full plain-GPT state dict; its files checked against the manifest first (``verify``)."""

    def weights_in_every_rank_file(self, tag_dir: Path) -> bool:
        """The weights live in every rank's files (ZeRO-3's partitions, DCP's shards), not model files."""

    def detect_layout(self, tag_dir: Path) -> tuple[int, int]:
        """(tp, pp) of the checkpoint."""

    def recorded_model_config(self, tag_dir: Path) -> Optional[dict]:
        """The ``model`` section its run was trained with, if recorded."""

    def to_relayout_format(self, tag_dir: Path, model_cfg: ModelConfig, out: Optional[Path] = None,
                           log: Callable = print) -> Path:
        """A checkpoint with its optimizer state that loads on any layout, or a ``ConvertError`` naming
        what to do instead (an engine that reshards on load needs none)."""


@dataclass(frozen=True)
class PlanNotes:
    """What ``megafixed plan``'s header says of an engine: text with ``str.format`` fields the command fills
    with engine-neutral figures of the config (``commands/plan.py``): ``{grad_gb}`` (one rank's gradients in
    the compute dtype, GB), ``{micro_batches}`` (the most micro batches a step can have: micro batch 1 at
    TP = PP = 1), ``{step_gb}`` (``grad_gb`` times that) and ``{gpus}``."""
    intro: Optional[str] = None  # a paragraph before the table
    accumulation: Optional[str] = None  # what its reductions do per micro batch
    grads: dict = field(default_factory=dict)  # precision ("fp32", "16-bit") -> the note on the grads column


class Planner(Protocol):
    """How ``megafixed plan`` sizes an engine's layouts (``megafixed.parallel.memory``, ``.traffic``); what its
    table says of the engine (its sharding column, its notes) is data, the engine's ``EngineFacts``."""

    def pp_partitions(self, pp: int) -> tuple[str, ...]: ...

    def sharding_options(self, dp: int) -> list[int] | tuple[int, ...]: ...

    def make_layout(self, cfg: Config, tp: int, pp: int, dp: int, option: int, micro: int, sp: bool,
                    part: str) -> Layout: ...

    def stage_bounds(self, weights: list, parts: int, method: str) -> list[int]:
        """Layer boundaries of ``parts`` pipeline stages by the engine's own partitioner (so a plan
        matches the real split); ``NotImplementedError`` for an engine that splits in its own plan."""

    def model_state_bytes(self, n_params: int, layout: Layout, precision: str) -> tuple[float, float, float]: ...

    def working_param_bytes(self, m: ModelConfig, layout: Layout, n_params: int, precision: str,
                            act_bytes: int) -> float: ...

    def reduction_phase(self, m: ModelConfig, layout: Layout, n_params: int, precision: str,
                        layer: float) -> tuple[float, Optional[float], float]: ...

    def pipeline_estimate(self, m: ModelConfig, seq: int, layout: Layout, precision: str,
                          masks: bool) -> Optional[Estimate]:
        """Its own pipeline's estimate, or None: the engine-neutral 1F1B one."""

    def dp_traffic(self, out: Traffic, m: ModelConfig, layout: Layout, n_params: int, blocks: int,
                   precision: str) -> None: ...

    def rank_sharding(self, layout: Layout) -> int: ...

    def sharding_overrides(self, layout: Layout) -> list[str]:
        """The ``section.key=value`` overrides that set ``layout``'s sharding (and split) in a config."""

    def fake_refusal(self, layout: Layout) -> Optional[str]: ...


@dataclass(frozen=True)
class EngineFacts:
    """What megafixed says and records of an engine: data, read by engine-neutral code (the registry, ``--dry-run``,
    ``megafixed plan``'s table and ``--pick``/``--fake``, the run record, the checkpoint commit), so no engine
    method produces words for a message."""
    # the format of a checkpoint no other engine claims and of a layout without "engine" (another tool's
    # DeepSpeed folder; ``megafixed import hf``/``convert`` output): one engine is the default
    default: bool
    # a regex of its checkpoint's file names that hold weights (what a weights-only reader verifies)
    model_files: str
    record_file: str  # <run_dir>/<record_file>: its own config, written next to the run's config
    config_title: str  # the name ``--dry-run`` gives its config
    # --dry-run's words: ``str.format`` fields of its config record (``engine_config``) and ``plan`` (its engine plan)
    dry_run_words: str
    column: tuple[str, int, tuple[str, ...]]  # plan's sharding column: title, width, the Layout fields shown
    notes: PlanNotes  # what plan's table header says of it
    layout_keys: tuple[str, ...]  # what a plan row sets beyond the engine-neutral keys (plan --pick)
    fake_worker: Optional[str]  # the module ``plan --fake`` runs per row; None: not measurable so
    # a file every checkpoint of its format holds (DCP's ``.metadata``), by which its tag folders are told apart;
    # None: the default format, which claims what no other engine's does
    checkpoint_marker: Optional[str] = None
    record_keys: tuple[str, ...] = ()  # its engine plan's fields a run record's layout keeps (DeepSpeed's zero_stage)
    derived_dirs: tuple[str, ...] = ()  # sub-folders of a tag it may make from it later (a re-layout copy): not saved


@dataclass(frozen=True)
class Relayout:
    """How a checkpoint of one run-record layout loads on another (``EngineKind.relayout``)."""
    keys: tuple[str, ...]  # the layout keys whose change means a re-layout on load
    refusal: Optional[str]  # why the checkpoint cannot be loaded on the other layout, or None


class EngineKind(Protocol):
    """One training engine, as megafixed asks it (a registered object; its methods import its library)."""

    name: str  # the train.engine value
    facts: EngineFacts  # what is said and recorded of it

    @property
    def checkpoint(self) -> CheckpointFormat: ...

    @property
    def planner(self) -> Planner: ...

    def make_plan(self, cfg: Config, dp: int, device: str = "cpu") -> Any:
        """Its frozen part of the run plan (``RunPlan.engine_plan``) for ``dp`` data-parallel ranks; its
        ``start_words`` field says what shards the state, for the trainer's start line."""

    def check_supported(self, cfg: Config, plan: RunPlan) -> None:
        """Raise its refusal (``LayoutError``/``ConfigError``) of what it cannot run."""

    def relayout(self, old: dict, new: dict) -> Relayout:
        """How a checkpoint of run-record layout ``old`` loads on ``new``: which keys' change is a re-layout,
        and why it cannot be (None: the engine re-lays it out on load)."""

    def setup_groups(self, plan: RunPlan) -> dict:
        """The ``Topology``'s process-group fields."""

    def build(self, cfg: Config, topo: Topology, hook: Optional[StepHook] = None) -> Engine: ...

    def engine_config(self, cfg: Config, plan: RunPlan) -> dict:
        """Its own config as JSON, for the machine the plan is for: what the engine ``build`` makes of ``plan``
        runs with, and what the trainer writes to ``<run_dir>/<facts.record_file>``."""

    def prepare_runtime_env(self) -> None:
        """Before its library is imported: its environment, its versions checked."""

    def accelerator_name(self) -> str:
        """The device kind its library computes on ("cuda", "cpu", ...)."""

    def dry_run_lines(self, cfg: Config, plan: RunPlan) -> list[str]:
        """``--dry-run``'s extra lines (e.g. a pipeline's bubble)."""
