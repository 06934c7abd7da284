"""Atomic file writes: the one helper every writer in megafixed uses.

A reader (another rank, a resumed run, a user's ``cat``) must never see half a file, and a crash
must leave the previous version in place. So we write to a temporary name in the same directory
(same filesystem, so ``os.replace`` is an atomic rename), fsync, then rename over the target.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Union

PathLike = Union[str, os.PathLike]


def temp_name(path: PathLike) -> str:
    """A hidden sibling of ``path`` that no other process writes (pid in the name)."""
    p = Path(path)
    return str(p.with_name(f".{p.name}.tmp.{os.getpid()}"))


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[str]:
    """Yield a temporary path to write; on success it replaces ``path``, on error it is removed.

    For writers that need a file name rather than a handle (``torch.save``, sentencepiece).
    """
    tmp = temp_name(path)
    try:
        yield tmp
        if os.path.exists(tmp):
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)


def atomic_write_text(path: PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
