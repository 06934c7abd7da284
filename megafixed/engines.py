"""Training engines as a registry: each engine is one object that says what it is; callers ask, never test names.

An engine (``train.engine``) owns the model on each rank, its optimizer, its process groups and
its checkpoint files. Every part of megafixed that depends on which one a run uses asks its
registered object here; what it must answer is typed by three protocols:

* ``EngineKind``, the engine itself: its name (the ``train.engine`` value), its record file in the
  run directory, its part of the run plan (``make_plan``: a frozen dataclass from the config,
  ``RunPlan.engine_plan``) and the config keys that part reads (``planned_keys``), its refusals, its
  re-layout rule, its process groups, its build, its own config, its runtime environment, and how it
  describes itself (the start line, ``--dry-run``, the run record's layout keys);
* ``CheckpointFormat`` (``kind.checkpoint``): how its checkpoints are recognised and read; a
  checkpoint is read by the engine whose detector claims it, the default engine's format last;
* ``Planner`` (``kind.planner``): how ``megafixed plan`` sizes its layouts.

An engine's methods import its library when called, so this module, the registry lookups and the
built-in engines' classes import no engine library (``megafixed plan``, ``--help`` and
``--dry-run`` stay light, and the config can validate ``train.engine`` here without an import
cycle). The built-in engines register themselves in ``megafixed/engine/deepspeed/kind.py`` and
``megafixed/engine/native/kind.py``, imported by the names in ``BUILTIN`` (not an import statement:
this module sits below the engines) the first time the registry is asked. Adding an engine is one
class implementing ``EngineKind`` and one ``register(...)`` (tests/test_engine_registry.py registers
a toy one).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

if TYPE_CHECKING:  # annotations only: the engines and the config import this module
    from .config import Config, ModelConfig
    from .engine.base import Engine, StepHook
    from .parallel.memory import Estimate, Layout
    from .parallel.topology import Topology
    from .parallel.traffic import Traffic
    from .run_plan import RunPlan

# The built-in engines' modules, imported on first use (each calls ``register`` once).
BUILTIN = ("megafixed.engine.deepspeed.kind", "megafixed.engine.native.kind")


class UnknownEngine(ValueError):
    """A ``train.engine`` no registered engine has (the CLI reports it as bad input)."""


class CheckpointFormat(Protocol):
    """How an engine's checkpoint files are recognised and read into a plain GPT state dict."""

    def is_checkpoint(self, tag_dir: Path) -> bool:
        """Whether ``tag_dir`` is this engine's (the default engine's format claims anything)."""

    def resolve_tag_dir(self, ckpt: Path, tag: Optional[str] = None) -> Path:
        """The tag directory of ``ckpt`` (a tag directory, or a checkpoint root with ``latest`` or ``tag``)."""

    def read_state_dict(self, tag_dir: Path, *, verify: bool = True) -> dict:
        """The full plain-GPT state dict; its files checked against the manifest first (``verify``)."""

    def is_model_file(self, name: str) -> bool:
        """A file that holds weights (what a weights-only reader verifies)."""

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


class Planner(Protocol):
    """How ``megafixed plan`` sizes an engine's layouts (``megafixed.parallel.memory``, ``.traffic``)."""

    COLUMN: tuple[str, int]  # the sharding column's title and width
    LAYOUT_KEYS: tuple[str, ...]  # what a row sets beyond the engine-neutral keys (plan --pick)
    FAKE_WORKER: Optional[str]  # the module ``plan --fake`` runs per row; None: not measurable so

    def pp_degrees(self, gpus: int, tp: int) -> range: ...

    def pp_partitions(self, pp: int) -> tuple[str, ...]: ...

    def sharding_options(self, dp: int) -> list[int] | tuple[int, ...]: ...

    def set_sharding(self, cfg: Config, option: int) -> None: ...

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

    def sharding_text(self, layout: Layout) -> str: ...

    def sharding_overrides(self, layout: Layout) -> list[str]: ...

    def intro(self, precision: str) -> Optional[str]: ...

    def accumulation_note(self, m: ModelConfig, gpus: int, global_batch: int, precision: str) -> Optional[str]: ...

    def grads_note(self, precision: str) -> str: ...

    def fake_refusal(self, layout: Layout) -> Optional[str]: ...


class EngineKind(Protocol):
    """One training engine, as megafixed asks it (a registered object; its methods import its library)."""

    name: str  # the train.engine value
    record_file: str  # <run_dir>/<record_file>: its own config, written next to the run's config
    planned_keys: tuple[str, ...]  # config keys its plan part reads, as "section.key" (RunPlan.check_made_from)
    default: bool  # what wrote a run record without "engine" (records from before the registry)

    @property
    def checkpoint(self) -> CheckpointFormat: ...

    @property
    def planner(self) -> Planner: ...

    def make_plan(self, cfg: Config) -> Any:
        """Its frozen part of the run plan (``RunPlan.engine_plan``)."""

    def check_supported(self, cfg: Config, plan: RunPlan) -> None:
        """Raise its refusal (``LayoutError``/``ConfigError``) of what it cannot run."""

    def relayout_refusal(self, old: dict, new: dict) -> Optional[str]:
        """Why a checkpoint of run-record layout ``old`` cannot be loaded on ``new``, or None."""

    def setup_groups(self, plan: RunPlan) -> dict:
        """The ``Topology``'s process-group fields."""

    def build(self, cfg: Config, topo: Topology, hook: Optional[StepHook] = None) -> Engine: ...

    def engine_config(self, cfg: Config, plan: RunPlan) -> dict:
        """Its own config as JSON, for the machine the plan is for."""

    def prepare_runtime_env(self) -> None:
        """Before its library is imported: its environment, its versions checked."""

    def accelerator_name(self) -> str:
        """The device kind its library computes on ("cuda", "cpu", ...)."""

    def start_words(self, plan: RunPlan) -> str:
        """What shards the state, for the trainer's start line."""

    def config_title(self) -> str:
        """The name ``--dry-run`` gives its config."""

    def dry_run_words(self, plan: RunPlan, record: dict) -> str: ...

    def dry_run_lines(self, cfg: Config, plan: RunPlan) -> list[str]:
        """``--dry-run``'s extra lines (e.g. a pipeline's bubble)."""

    def record_layout(self, plan: RunPlan) -> dict:
        """Its own keys in a run record's layout."""

    def layout_change_keys(self, plan: RunPlan, recorded: dict) -> list[str]:
        """The layout keys whose change from ``recorded`` means a re-layout."""


_REGISTRY: dict[str, EngineKind] = {}
_loaded = False


def register(kind: EngineKind) -> EngineKind:
    """Add an engine (a test may register a toy one and ``unregister`` it after)."""
    if kind.name in _REGISTRY and _REGISTRY[kind.name] is not kind:
        raise ValueError(f"an engine named {kind.name!r} is already registered")
    if kind.default and any(k.default for k in _REGISTRY.values() if k.name != kind.name):
        raise ValueError(f"engine {kind.name!r}: only one engine can be the default")
    _REGISTRY[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def _ensure_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN:
            importlib.import_module(module)


def kinds() -> list[EngineKind]:
    """Every registered engine, the default first, then in registration order."""
    _ensure_builtins()
    return sorted(_REGISTRY.values(), key=lambda k: not k.default)


def names() -> list[str]:
    return [k.name for k in kinds()]


def default_kind() -> EngineKind:
    return next(k for k in kinds() if k.default)


def engine_kind(name: Optional[str], error: type = UnknownEngine) -> EngineKind:
    """The engine called ``name`` (None or "": the default one, as an old run record means)."""
    _ensure_builtins()
    if not name:
        return default_kind()
    if name not in _REGISTRY:
        raise error(f"train.engine={name!r} is not one of {names()}")
    return _REGISTRY[name]


def kind_of(plan_or_layout: Any) -> EngineKind:
    """The engine of a run plan, a topology's plan, or a run-record layout (a dict; a record
    without "engine" was written by the default engine)."""
    if isinstance(plan_or_layout, dict):
        return engine_kind(plan_or_layout.get("engine"))
    return engine_kind(getattr(plan_or_layout, "engine", None))


def checkpoint_kind(tag_dir: Path) -> EngineKind:
    """The engine whose checkpoint format ``tag_dir`` is: the first non-default engine whose
    detector claims it, else the default engine (whose readers name what is missing)."""
    for kind in kinds()[1:]:
        if kind.checkpoint.is_checkpoint(Path(tag_dir)):
            return kind
    return default_kind()


def planned_keys() -> tuple:
    """Every registered engine's planned keys, in registration order (the default's first)."""
    out: list[str] = []
    for kind in kinds():
        out.extend(k for k in kind.planned_keys if k not in out)
    return tuple(out)
