"""The callbacks of a run: the built-in ones, each from its own config section, in one list, and the
user's own (``callbacks:`` in the config, or ``train(cfg, topo, callbacks=[...])``).

``BUILT_IN`` is the registration list: ``(section, module)``, ``section`` the name of the config section
(a dataclass on ``Config``) and ``module`` the file whose ``build(section_cfg, cfg)`` makes the callback (None:
it is off).
Its order is the order every hook is called in (see each entry's comment for why it stands where it is).
Adding a built-in callback = its own file + its config section on ``Config`` + one line here.
"""
from __future__ import annotations

import importlib
from typing import Optional

from ...errors import ConfigError
from .base import Callback, Rewind, RunContext  # noqa: F401 -- the API a callback is written against

BUILT_IN = [
    ("faults", "drills"),  # first: an injected exit or hang comes before the watchdog sees the step begin
    ("profile", "profile"),  # its step range opens before the other callbacks' before_step work
    ("validation", "validation"),  # its step-0 pass before the watchdog starts; its val_loss before the record
    ("watchdog", "hang"),
    ("stragglers", "stragglers"),  # after the drills: the ``slow`` drill's spin is timed as compute
    ("guard", "guard"),  # the bad-step guard, its re-check, rollbacks and skipped data (a package)
    ("eval", "zero_shot"),  # in-loop zero-shot scores of the settled update, in a record of their own
    ("wandb", "wandb"),  # before metrics: a sink of the records the metrics log writes
    ("metrics", "metrics"),  # after every callback that adds to a step's record
    ("train", "pause"),  # a test's pause point between steps (MEGAFIXED_PAUSE), after the step's record and save
    ("train", "evidence"),  # last: what a failed run leaves, after the others have closed their files
]


def _build(module: str, section, cfg) -> Optional[Callback]:
    """``module``'s ``build(section, cfg)``: imported only when a run builds its callbacks (``--help`` and
    the config check of a refused run import none of them)."""
    return importlib.import_module(f".{module}", __name__).build(section, cfg)


def build_callbacks(cfg, given: list) -> list:
    """The run's callbacks: the built-in ones that are on, then ``cfg.callbacks``, then ``given``; names
    unique (each is the key of its state in the checkpoint)."""
    out = [cb for section, module in BUILT_IN for cb in [_build(module, getattr(cfg, section), cfg)] if cb is not None]
    out += [user_callback(entry, i) for i, entry in enumerate(cfg.callbacks)]
    out += list(given)
    seen: dict = {}
    for cb in out:
        if not cb.name:
            cb.name = f"{type(cb).__module__}:{type(cb).__qualname__}"
        if cb.name in seen:
            raise ConfigError(f"two callbacks are named {cb.name!r}; give each a name of its own (its state's key "
                              f"in the checkpoint)")
        seen[cb.name] = cb
    return out


def user_callback(entry, index: int) -> Callback:
    """``{name: "package.module:Class", args: {...}}`` from ``callbacks:``, built; a bad entry is one line."""
    where = f"callbacks[{index}]"
    if not isinstance(entry, dict) or set(entry) - {"name", "args"} or not isinstance(entry.get("name"), str):
        raise ConfigError(f"{where}={entry!r} must be a mapping {{name: 'package.module:Class', args: {{...}}}}")
    name, args = entry["name"], entry.get("args") or {}
    if not isinstance(args, dict):
        raise ConfigError(f"{where}.args={args!r} must be a mapping of the constructor's keyword arguments")
    module_name, colon, attr = name.partition(":")
    if not colon or not module_name or not attr:
        raise ConfigError(f"{where}.name={name!r} must be 'package.module:Class'")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{where}.name={name!r} cannot be imported ({exc}); name an importable "
                          f"'package.module:Class'") from None
    try:
        cb = obj(**args)
    except TypeError as exc:
        raise ConfigError(f"{where}: {name}({', '.join(f'{k}=' for k in args)}...) failed: {exc}") from None
    if not isinstance(cb, Callback):
        raise ConfigError(f"{where}.name={name!r} is not a megafixed.train.callbacks.Callback")
    return cb


class CallbackHooks:
    """The engine's one step-level hook (``engine.base.StepHook``), answered by the callbacks: a verdict on the
    reduced loss and the global gradient norm before the update, and what each micro batch's loss passes on
    its way to its backward. Only the callbacks that override ``micro_loss`` are asked per micro batch."""

    def __init__(self, callbacks: list):
        self.judges = [cb for cb in callbacks if type(cb).judge_step is not Callback.judge_step]
        self.taps = [cb for cb in callbacks if type(cb).micro_loss is not Callback.micro_loss]

    def judge(self, step: int, what: str, value: Optional[float]):
        loss, norm = (value, None) if what == "loss" else (None, value)
        if value is None:
            return None
        for cb in self.judges:
            verdict = cb.judge_step(step, loss, norm)
            if verdict is not None:
                return verdict
        return None

    def loss(self, loss, step: int):
        for cb in self.taps:
            loss = cb.micro_loss(step, loss)
        return loss
