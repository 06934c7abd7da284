"""matplotlib is optional (``pip install 'megafixed[plot]'``): every PNG goes through this check, so
a missing matplotlib is said before any work starts (``probe --plot``) or said once when PNGs are
skipped (``study``), never a traceback after the work is done."""
from __future__ import annotations

import importlib.util

INSTALL = "pip install 'megafixed[plot]'"


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def require_matplotlib(flag: str) -> None:
    """Refuse ``flag`` (e.g. ``--plot probe.png``) up front when matplotlib is missing."""
    if not have_matplotlib():
        from .config import ConfigError

        raise ConfigError(f"{flag} needs matplotlib, which is not installed: {INSTALL} (or drop {flag.split()[0]})")


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on clusters and CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
