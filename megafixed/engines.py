"""The engine registry: training engines by name (``train.engine``); callers ask, never test names.

Only a table of names: what an engine answers is the engine seam's, ``megafixed.engine`` (its protocols
in ``megafixed/engine/protocols.py``: ``EngineKind``, ``CheckpointFormat``, ``Planner``). This module imports
nothing of megafixed, not even for annotations, and no engine library, so it sits beneath everything
that looks an engine up: the config (which validates ``train.engine`` here), ``parallel/`` (the memory
model asks an engine's planner, the topology its groups) and the run plan. Inside ``megafixed/engine/`` it
would close a cycle: that package imports the config, the run plan and ``parallel/``.

The built-in engines register themselves in ``megafixed/engine/deepspeed/kind.py`` and
``megafixed/engine/native/kind.py``, imported by the names in ``BUILTIN`` (not an import statement: this
module sits below the engines) the first time the registry is asked. Adding an engine is one class
implementing ``EngineKind`` and one ``register(...)`` (tests/test_engine_registry.py registers a toy one).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Optional

# The built-in engines' modules, imported on first use (each calls ``register`` once).
BUILTIN = ("megafixed.engine.deepspeed.kind", "megafixed.engine.native.kind")


class UnknownEngine(ValueError):
    """A ``train.engine`` no registered engine has (the CLI reports it as bad input)."""


_REGISTRY: dict[str, Any] = {}
_loaded = False


def register(kind: Any) -> Any:
    """Add an engine (a test may register a toy one and ``unregister`` it after)."""
    if kind.name in _REGISTRY and _REGISTRY[kind.name] is not kind:
        raise ValueError(f"an engine named {kind.name!r} is already registered")
    if kind.facts.default and any(k.facts.default for k in _REGISTRY.values() if k.name != kind.name):
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


def kinds() -> list:
    """Every registered engine, the default first, then in registration order."""
    _ensure_builtins()
    return sorted(_REGISTRY.values(), key=lambda k: not k.facts.default)


def names() -> list[str]:
    return [k.name for k in kinds()]


def default_kind() -> Any:
    return next(k for k in kinds() if k.facts.default)


def engine_kind(name: Optional[str], error: type = UnknownEngine) -> Any:
    """The engine called ``name`` (None or "": the default one, whose format a layout without "engine" is in:
    ``megafixed import hf``/``convert`` output, another tool's checkpoint)."""
    _ensure_builtins()
    if not name:
        return default_kind()
    if name not in _REGISTRY:
        raise error(f"train.engine={name!r} is not one of {names()}")
    return _REGISTRY[name]


def kind_of(plan_or_layout: Any) -> Any:
    """The engine of a run plan, a topology's plan, or a run-record layout (a dict; a layout without
    "engine" is in the default engine's format)."""
    if isinstance(plan_or_layout, dict):
        return engine_kind(plan_or_layout.get("engine"))
    return engine_kind(getattr(plan_or_layout, "engine", None))


def checkpoint_kind(tag_dir: Path) -> Any:
    """The engine whose checkpoint format ``tag_dir`` is: the first non-default engine whose marker file
    (``EngineFacts.checkpoint_marker``) it holds, else the default engine (whose readers name what is missing)."""
    for kind in kinds()[1:]:
        if (Path(tag_dir) / kind.facts.checkpoint_marker).is_file():
            return kind
    return default_kind()

