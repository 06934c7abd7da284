"""The one error boundary of the ``megafixed`` CLI: any exception -> (exit code, one line).

Why one place: a user who mistypes a path should read one line that names the file (or config
key) and the fix, not a traceback from PyYAML, gzip, sentencepiece or torch.distributed. Every
verb runs under :func:`report` (``cli.main``; ``train`` and ``quickstart`` call it themselves
before ``os._exit``). Rules:

* :func:`describe` maps an exception to ``(exit code, line)``; it returns ``None`` for what looks
  like a bug of ours (TypeError, KeyError, ...), whose traceback is then shown because that is
  what a developer needs.
* Errors of our own (``ConfigError``, ``DataError``, ``CodeError``, ``ConvertError``,
  ``CheckpointError``, ``LayoutError``, ``OutputError``, ...) are ValueErrors whose message
  already names the key or file and the fix: exit 2 (``exit_codes.BAD_INPUT``).
* Library exceptions lose the file name; readers catch them where the file is known and raise a
  ``DataError`` naming it. What still reaches here gets a generic but actionable line.
* ``MEGAFIXED_TRACEBACK=1`` re-raises, so the full traceback is one variable away.
* Under torchrun every rank fails the same way; only rank 0 prints (RANK unset or "0").
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from . import env as env_vars
from . import exit_codes


class ConfigError(ValueError):
    """A bad config key or value; the message names the key and what would be valid. Defined here,
    with the boundary that reports it, so that ``config`` and ``config_checks`` both import it
    from below (``megafixed.config.ConfigError`` is the same class)."""


class UsageError(ValueError):
    """A bad command line (argparse's complaint), reported as one line instead of usage + error."""


def _one_line(text: str) -> str:
    """Library messages span lines (YAML marks, torch's C++ frames); keep the meaningful ones."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    # torch/C++ messages append "Exception raised from ... (most recent call first):" frames
    for i, ln in enumerate(lines):
        if ln.startswith(("Exception raised from", "frame #")):
            lines = lines[:i]
            break
    return "; ".join(lines) or "(no message)"


def _ours(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0] == "megafixed"


def _path_of(exc: OSError) -> str:
    return os.fspath(exc.filename) if exc.filename is not None else ""


def _describe_os(exc: OSError) -> tuple[int, str]:
    path = _path_of(exc)
    what = exc.strerror or _one_line(exc)
    if isinstance(exc, FileNotFoundError):
        return exit_codes.BAD_INPUT, (f"{path or 'a file'}: not found; check the path (relative paths start at "
                                      f"{os.getcwd()})")
    if isinstance(exc, PermissionError):
        return exit_codes.BAD_INPUT, f"{path or 'a file'}: permission denied; choose a path you can read/write"
    if isinstance(exc, IsADirectoryError):
        return exit_codes.BAD_INPUT, f"{path}: is a directory, but a file was expected; name a file"
    if isinstance(exc, NotADirectoryError):
        return exit_codes.BAD_INPUT, f"{path}: a part of this path is a file, not a directory; fix the path"
    if isinstance(exc, FileExistsError):
        return exit_codes.BAD_INPUT, f"{path}: already exists; choose another path or remove it"
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return exit_codes.FAILED, f"{path or 'disk'}: no space left on device; free space or write elsewhere"
    if path:
        return exit_codes.BAD_INPUT, f"{path}: {what}"
    return exit_codes.BAD_INPUT, _one_line(exc)


def _describe_library(exc: BaseException) -> Optional[tuple[int, str]]:
    """Known exceptions of the libraries underneath, for the cases no reader could wrap."""
    text = _one_line(exc)
    try:
        import yaml
    except ImportError:  # pragma: no cover - a dependency
        yaml = None
    if yaml is not None and isinstance(exc, yaml.YAMLError):
        mark = getattr(exc, "problem_mark", None)
        where = f"{mark.name} line {mark.line + 1}" if mark is not None else "a YAML file"
        problem = getattr(exc, "problem", None) or text
        return exit_codes.BAD_INPUT, f"{where} is not valid YAML ({problem}); fix its syntax"
    if isinstance(exc, UnicodeDecodeError):
        return exit_codes.BAD_INPUT, (f"a file is not UTF-8 text ({exc.reason} at byte {exc.start}); re-save it "
                                      f"as UTF-8")
    import gzip
    import zlib

    if isinstance(exc, (gzip.BadGzipFile, zlib.error)) or (isinstance(exc, EOFError) and "compressed" in text):
        return exit_codes.BAD_INPUT, (f"a compressed input is corrupt or truncated ({text}); re-download or "
                                      f"re-compress it")
    if type(exc).__module__.startswith("zstandard"):
        return exit_codes.BAD_INPUT, f"a .zst input is corrupt or truncated ({text}); re-download or re-compress it"
    if isinstance(exc, MemoryError):
        return exit_codes.FAILED, (f"out of memory ({text or 'allocation failed'}); lower the size asked for "
                                   f"(batch, bits, workers) or use a machine with more memory")
    try:
        import torch
    except ImportError:  # pragma: no cover - a dependency
        torch = None
    if torch is not None:
        if isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
            return exit_codes.FAILED, (f"GPU out of memory ({text[:200]}); lower train.micro_batch, turn on "
                                       f"train.activation_checkpointing, or see `megafixed plan`")
        dist_errors = tuple(getattr(torch.distributed, n) for n in ("DistError",) if hasattr(torch.distributed, n))
        if "nccl" in text.lower() and isinstance(exc, (RuntimeError, ValueError)):
            return exit_codes.BAD_INPUT, (f"torch.distributed NCCL backend unavailable ({text[:200]}); NCCL needs "
                                          f"CUDA GPUs: set parallel.backend=gloo (or auto) on this machine")
        if dist_errors and isinstance(exc, dist_errors):
            return exit_codes.FAILED, (f"torch.distributed failed ({text[:300]}); check MASTER_ADDR/MASTER_PORT, "
                                       f"that every rank was launched, and the other ranks' logs")
    if isinstance(exc, RuntimeError) and "vocabulary size too high" in text.lower():
        return exit_codes.BAD_INPUT, f"sentencepiece: {text}; lower --vocab-size or train on more text"
    return None


def describe(exc: BaseException) -> Optional[tuple[int, str]]:
    """``(exit code, one line)`` for a user-facing failure, or ``None`` for a bug (show the traceback)."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return None
    if _ours(exc):
        if isinstance(exc, ValueError):
            return exit_codes.BAD_INPUT, _one_line(exc)
        if isinstance(exc, RuntimeError):  # e.g. NonFiniteLossError: the run itself failed
            return exit_codes.FAILED, _one_line(exc)
    known = _describe_library(exc)
    if known is not None:
        return known
    if isinstance(exc, OSError):
        return _describe_os(exc)
    if isinstance(exc, ValueError):
        # A library's ValueError on a value we passed through from the user; its text is the best
        # we have. Our own code raises named errors, so this stays rare.
        return exit_codes.BAD_INPUT, _one_line(exc)
    return None


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") in ("", "0")


def traceback_wanted() -> bool:
    return env_vars.traceback_wanted()


def report(exc: BaseException, file=None) -> int:
    """Print ``error: <line>`` (rank 0 only) and return the exit code; call inside ``except``.

    Re-raises (so the traceback shows) when ``MEGAFIXED_TRACEBACK=1`` or when the exception looks
    like a bug. It prints and nothing else: callers that must leave with ``os._exit`` can.
    """
    if traceback_wanted():
        raise exc
    found = describe(exc)
    if found is None:
        raise exc
    code, line = found
    notes = [n for n in getattr(exc, "__notes__", ()) if n]  # e.g. where a failed run's files are kept
    line = "; ".join([line, *notes]) if notes else line
    # every_rank: a failure that rank 0 may not see (it is the missing rank), e.g. an unreachable master
    if _is_rank0() or getattr(exc, "every_rank", False):
        print(f"error: {line}", file=file or sys.stderr, flush=True)
    return code
