"""Training engines as a registry: each one says once what it is; callers ask, never test names.

An engine (``train.engine``) owns the model on each rank, its optimizer, its process groups and
its checkpoint files. Every part of megafixed that depends on which one a run uses asks its
``EngineKind`` here (the shape is ``megafixed.model.interfaces``, the input-interface registry):

* what it is: its name (the ``train.engine`` value), its config section (``zero``,
  ``torch_engine``; None: it has none) and its record file in the run directory;
* its part of the run plan (``make_plan``: a frozen dataclass from the config, ``plan.engine_plan``)
  and the config keys that part reads (``planned_keys``: ``RunPlan.check_made_from`` compares them);
* its refusals (``check_supported``), its re-layout rule (``relayout_refusal``), its process groups
  (``setup_groups``), its build (``build``), its own config (``engine_config``), its runtime
  environment and version check (``prepare_runtime_env``), its pipeline partitioner (``stage_bounds``);
* its checkpoint format (``checkpoint``: a module with ``is_checkpoint``, ``read_state_dict``,
  ``is_model_file``, ``weights_in_every_rank_file``, ``detect_layout``, ``recorded_model_config``,
  ``to_relayout_format``, ``resolve_tag_dir``): a checkpoint is read by the engine whose detector
  claims it, the default engine's format last;
* how it describes itself (``describe``: a module with ``start_words``, ``dry_run_words``,
  ``record_layout``, ``layout_change_keys``) and how ``megafixed plan`` sizes it (``planner``).

Hooks are callables or ``"module:attribute"`` strings, imported on first use, so this module imports
nothing of megafixed and no engine library (``megafixed plan``, ``--help`` and ``--dry-run`` stay
light, and the config can validate ``train.engine`` against it without an import cycle). The built-in
engines register themselves in ``megafixed/engine/deepspeed/kind.py`` and ``megafixed/engine/native/
kind.py``, which are imported (by a name listed here, not an import statement: this module sits below
the engines) the first time the registry is asked. Adding an engine is one ``register(EngineKind(...))``
plus its tests (tests/test_engine_registry.py registers a toy one).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

Hook = Union[str, Callable, None]

# The built-in engines' records, imported on first use (each calls ``register`` once).
BUILTIN = ("megafixed.engine.deepspeed.kind", "megafixed.engine.native.kind")


class UnknownEngine(ValueError):
    """A ``train.engine`` no registered engine has (the CLI reports it as bad input)."""


def _resolve(hook: Hook, what: str) -> Any:
    if hook is None:
        raise NotImplementedError(what)
    if callable(hook) or not isinstance(hook, str):
        return hook
    module, _, attr = hook.partition(":")
    target = importlib.import_module(module)
    return getattr(target, attr) if attr else target


@dataclass(frozen=True)
class EngineKind:
    name: str  # the train.engine value
    summary: str  # one line: what the engine is
    record_file: str  # <run_dir>/<record_file>: its own config, written next to the run's config
    make_plan: Hook  # cfg -> the engine's frozen part of the run plan (plan.engine_plan)
    check_supported: Hook  # (cfg, plan) -> None, or the engine's refusal (LayoutError/ConfigError)
    relayout_refusal: Hook  # (old layout, new layout) -> why not, or None
    setup_groups: Hook  # plan -> the Topology's process-group fields (a dict)
    build: Hook  # (cfg, topo, checks: StepChecks or None) -> this rank's Engine
    engine_config: Hook  # (cfg, plan) -> the engine's config as JSON
    checkpoint: Hook  # the module that reads its checkpoints (see the module docstring)
    describe: Hook  # the module of its self-description (see the module docstring)
    planner: Hook  # the module that sizes its layouts for `megafixed plan`
    config_section: Optional[str] = None  # its Config section (zero, torch_engine)
    planned_keys: tuple = ()  # config keys its plan part reads, as "section.key"
    prepare_runtime_env: Hook = None  # () -> None: before its library is imported; checks its versions
    stage_bounds: Hook = None  # (weights, parts, method) -> stage boundaries; None: no pipeline
    default: bool = False  # what wrote a run record without "engine" (records from before the registry)
    extra: dict = field(default_factory=dict)  # anything else an engine wants to say about itself

    def hook(self, name: str) -> Any:
        """The hook ``name`` (imported now, if it is a module path)."""
        return _resolve(getattr(self, name), f"train.engine={self.name} has no {name}")

    def call(self, name: str, *args, **kwargs) -> Any:
        return self.hook(name)(*args, **kwargs)


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


def checkpoint_kind(tag_dir: Any) -> EngineKind:
    """The engine whose checkpoint format ``tag_dir`` is: the first non-default engine whose
    detector claims it, else the default engine (whose readers name what is missing)."""
    for kind in kinds()[1:]:
        if kind.hook("checkpoint").is_checkpoint(tag_dir):
            return kind
    return default_kind()


def planned_keys() -> tuple:
    """Every registered engine's planned keys, in registration order (the default's first)."""
    out: list[str] = []
    for kind in kinds():
        out.extend(k for k in kind.planned_keys if k not in out)
    return tuple(out)
