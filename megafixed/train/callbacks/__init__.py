"""The run's callbacks (``base.Callback``). Built-in ones are registered here: the config section
(a dataclass on ``Config``) each is built from and its factory ``build(section, cfg)`` (None: off)."""
from __future__ import annotations

from .base import Callback, RunContext  # noqa: F401  (the seam's types)


def _zero_shot(section, cfg):
    from .zero_shot import build

    return build(section, cfg)


BUILT_IN = (
    ("eval", _zero_shot),
)


def build_callbacks(cfg) -> list[Callback]:
    """The built-in callbacks ``cfg`` turns on, in registration order."""
    made = (factory(getattr(cfg, section), cfg) for section, factory in BUILT_IN)
    return [c for c in made if c is not None]
