"""The engine versions megafixed is tested with, checked at start-up of the verbs that use them.

The trainer relies on DeepSpeed and megatron-core internals (engine and pipeline hooks, ZeRO
partitioning, ``parallel_state``) that change between minor releases, so an untested version fails
in obscure places mid-run, if at all. ``check_engines()`` fails early instead, with one line naming
the installed and the tested version and the pip command that fixes it. ``MEGAFIXED_ALLOW_UNTESTED=1``
turns the failure into a warning (to try a newer release on purpose).

Versions are read from the installed distributions' metadata, so the check does not import the
engines (DeepSpeed picks its accelerator at import; see ``engine/deepspeed/env.py``). Keep ``TESTED`` in step with
``install_requires`` in setup.py.
"""
from __future__ import annotations

import importlib.metadata
import re
import warnings

from . import env as env_vars

# distribution -> (lowest tested version, first untested version): the ranges setup.py pins.
TESTED = {
    "deepspeed": ("0.19.8", "0.20"),
    "megatron-core": ("0.16.1", "0.17"),
}
ALLOW_ENV = "MEGAFIXED_ALLOW_UNTESTED"


class UntestedEngineError(ValueError):
    """An installed engine is outside the tested range (or missing). A ValueError like the project's
    other errors, so the CLI prints its one line (exit 2) instead of a traceback."""


def _parse(version: str) -> tuple[int, ...]:
    """'0.19.8' -> (0, 19, 8); '0.20.0rc1+cu124' -> (0, 20, 0): the leading release numbers only.
    A pre-release of the first untested version then counts as untested, which is what we want."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def engine_problems() -> list[str]:
    """One sentence per engine that is missing or outside its tested range; empty when all is well."""
    out = []
    for dist, (low, high) in TESTED.items():
        have = installed_version(dist)
        fix = f'pip install "{dist}>={low},<{high}"'
        if have is None:
            out.append(f"{dist} is not installed; megafixed is tested with {dist} {low} (<{high}): {fix}")
        elif not (_parse(low) <= _parse(have) < _parse(high)):
            out.append(f"{dist} {have} is installed but megafixed is tested with {dist} {low} (<{high}): {fix}")
    return out


def check_engines() -> None:
    """Raise ``UntestedEngineError`` (one line per bad engine) unless ``MEGAFIXED_ALLOW_UNTESTED=1``,
    which warns instead."""
    problems = engine_problems()
    if not problems:
        return
    if env_vars.allow_untested():
        for p in problems:
            warnings.warn(f"{p} (running anyway: {ALLOW_ENV} is set)", RuntimeWarning, stacklevel=2)
        return
    raise UntestedEngineError("; ".join(problems) + f" (or set {ALLOW_ENV}=1 to run anyway)")
