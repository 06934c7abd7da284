"""Where megafixed reads its bundled files and writes its caches, independent of the cwd and of
how it was installed.

* ``bundled(name)`` / ``resolve(path)``: files shipped inside the package (``megafixed/bundled/``:
  the quickstart corpus and config). Configs name them as ``bundled:<name>``, which works from any
  directory and for a regular (non-editable) install, where there is no repository to anchor to.
* ``cache_dir(*parts)``: the user cache (tokenizers and shards made from ``data.source``, DeepSpeed's
  JIT-built ops). Never the install tree: it may be read-only, is shared by every user of the
  environment, and ``pip uninstall`` would leave the cache behind or ``pip install`` wipe it.
"""
from __future__ import annotations

import os
from pathlib import Path

from . import env as env_vars

BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"
BUNDLED_PREFIX = "bundled:"


def bundled(name: str) -> Path:
    """Absolute path of a file shipped in ``megafixed/bundled/`` (it need not exist)."""
    return BUNDLED_DIR / name


def resolve(path: str | None) -> str | None:
    """``bundled:<name>`` -> the packaged file's absolute path; anything else unchanged."""
    if path and str(path).startswith(BUNDLED_PREFIX):
        return str(bundled(str(path)[len(BUNDLED_PREFIX):].lstrip("/")))
    return path


def cache_dir(*parts: str) -> Path:
    """``$MEGAFIXED_CACHE_DIR``, else ``$XDG_CACHE_HOME/megafixed``, else ``~/.cache/megafixed``,
    joined with ``parts``. Only computes the path: callers create folders when they write into them,
    so a failed or read-only run leaves nothing behind."""
    root = env_vars.cache_dir()
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        # XDG says a relative XDG_CACHE_HOME is invalid and must be ignored.
        root = os.path.join(xdg if xdg and os.path.isabs(xdg) else os.path.join("~", ".cache"), "megafixed")
    return Path(os.path.abspath(os.path.expanduser(root))).joinpath(*parts)
