"""A checkpoint save the filesystem refused, named: which path, why, and what it needs.

A full disk during ``torch.save`` surfaces as ``RuntimeError: [enforce fail at
inline_container.cc:672] unexpected pos ...`` (torch's zip writer noticing a short write), with the
real ``OSError(ENOSPC)`` only in ``__context__`` when it wrote through a Python file object, and
nowhere at all when it wrote to a path itself. So ``filesystem_errno`` looks down the exception
chain first and, for torch's serialization errors without one, asks the filesystem (free space,
read-only flag, a probe write).

What a failed save leaves (``checkpoint.save`` / the async writer call ``cleanup``): ``latest``
where it was -- it only ever moves after a complete save -- and no partial tag directory.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Optional

from .run_dir import LATEST, MANIFEST, read_latest

WHY = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
       errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
       errno.EROFS: "read-only file system"}
# torch's zip writer / stream errors that mean "the bytes did not reach the file"
TORCH_WRITE_ERRORS = ("inline_container.cc", "PytorchStreamWriter", "unexpected pos", "file write failed",
                      "iostream error")


class CheckpointSaveError(RuntimeError):
    """A checkpoint save that failed for a reason outside the program (full disk, quota, permissions)."""


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _probe(directory: Path) -> Optional[int]:
    """The errno the filesystem under ``directory`` gives a small write now, or None if it works."""
    d = directory
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        st = os.statvfs(d)
        if st.f_flag & os.ST_RDONLY:
            return errno.EROFS
        if st.f_bavail * st.f_frsize < (1 << 20):
            return errno.ENOSPC
    except OSError as exc:
        return exc.errno
    probe = d / f".megafixed-probe.{os.getpid()}"
    try:
        with open(probe, "wb") as fh:
            fh.write(b"\0" * 65536)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        return exc.errno
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def filesystem_errno(exc: BaseException, directory: Path) -> Optional[int]:
    """The filesystem errno behind ``exc`` (one of ``WHY``), or None when the cause is not the filesystem."""
    torch_write = False
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in WHY:
            return e.errno
        torch_write = torch_write or (isinstance(e, RuntimeError) and any(t in str(e) for t in TORCH_WRITE_ERRORS))
    if torch_write:
        found = _probe(directory)
        return found if found in WHY else None
    return None


def human_size(n: float) -> str:
    """1536 -> '1.5 KiB' (error lines and `ckpt inspect`)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def checkpoint_bytes(tag_dir: Path) -> Optional[int]:
    """Total size of a complete checkpoint, from its manifest."""
    try:
        man = json.loads((Path(tag_dir) / MANIFEST).read_text())
        return sum(int(e["size"]) for e in man["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def free_bytes(directory: Path) -> Optional[int]:
    d = Path(directory)
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        st = os.statvfs(d)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def describe(code: int, ckpt_dir: Path, tag: str, handed_bytes: int = 0, asynchronous: bool = False) -> str:
    ckpt_dir = Path(ckpt_dir)
    try:
        latest = read_latest(ckpt_dir)
    except ValueError:
        latest = None
    where = ckpt_dir / tag
    mode = "the background (checkpoint.async_save) save of" if asynchronous else "saving"
    head = f"{mode} checkpoint {where} failed: {WHY[code]} ({ckpt_dir})"
    if code in (errno.ENOSPC, errno.EDQUOT):
        prev = checkpoint_bytes(ckpt_dir / latest) if latest else None
        need = (f"about {human_size(prev)} (the size of {latest})" if prev else
                f"at least {human_size(handed_bytes)} (what was handed to the writer before it failed)")
        free = free_bytes(ckpt_dir)
        head += f"; a checkpoint needs {need}" + (f", {human_size(free)} is free there" if free is not None else "")
        fix = ("free space there (or lower checkpoint.keep, or move train.run_dir to a larger filesystem; "
               "for a quota: `quota -s` / `lfs quota` shows yours)")
    elif code in (errno.EACCES, errno.EPERM):
        fix = f"make {ckpt_dir} writable for this user, or choose another train.run_dir"
    else:
        fix = f"remount {ckpt_dir}'s filesystem read-write, or choose another train.run_dir"
    kept = (f"`{LATEST}` still names {latest}, which is complete" if latest else
            f"there is no earlier checkpoint (no `{LATEST}`)")
    return f"{head}. {kept}; the partial {tag} was removed. To continue: {fix}, then run the same command again"


def cleanup(ckpt_dir: Path, tag: str) -> None:
    """Remove a failed save's tag directory (never the one ``latest`` names)."""
    try:
        latest = read_latest(ckpt_dir)
    except ValueError:
        latest = None
    if tag != latest:
        shutil.rmtree(Path(ckpt_dir) / tag, ignore_errors=True)


def named(exc: BaseException, ckpt_dir: Path, tag: str, is_main: bool, handed_bytes: int = 0,
          asynchronous: bool = False) -> BaseException:
    """What a failed save should raise: a ``CheckpointSaveError`` when the filesystem is the cause
    (after rank 0 removed the partial tag), otherwise ``exc`` itself."""
    code = filesystem_errno(exc, Path(ckpt_dir))
    if is_main:
        cleanup(Path(ckpt_dir), tag)
    if code is None:
        return exc
    err = CheckpointSaveError(describe(code, Path(ckpt_dir), tag, handed_bytes, asynchronous))
    err.__cause__ = exc
    return err


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in a (nested) state dict: what ``torch.save`` of it writes, about. A
    DTensor (the torch engine's shards) counts this rank's local part, which is what this rank writes."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = getattr(obj, "_local_tensor", obj)
        return t.numel() * t.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0
