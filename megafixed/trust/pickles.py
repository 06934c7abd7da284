"""Read what a pickle would import without unpickling it, and load weights without running code.

``torch.load(weights_only=True)`` protects our own reads; DeepSpeed's ``load_checkpoint`` and DCP's
``FileSystemReader`` unpickle with no restriction (``weights_only=False``, ``pickle.load``), so every
pickle they will read is scanned first (``check_tag_dir``): the opcodes are walked with ``pickletools``
(a static read: nothing is imported or called) and each ``GLOBAL``/``STACK_GLOBAL`` must name an
allowed global. A ``STACK_GLOBAL`` whose module or name is not a constant string in the pickle cannot
be told statically and is refused too. torch's own ``get_unsafe_globals_in_checkpoint`` does the same
for ``torch.save`` files but stops at the first opcode protocol 2 does not use (a ``torch.save(...,
pickle_protocol=4)`` file, DCP's ``.metadata``), so one walker serves every file here.

What is scanned in a tag directory (and under it: ``universal/``): each file an allow-list names
(``*.pt``: a torch zip, its ``data.pkl``; DCP's ``.metadata``: a plain pickle) and, for DCP, each
non-tensor item stored in the ``.distcp`` shards (``torch.save`` bytes that DCP loads with
``weights_only=False`` on a resume).
"""
from __future__ import annotations

import io
import pickletools
import zipfile
from pathlib import Path
from typing import Union

from .allowlist import allow_lists, allowed_globals, pickled_file
from .errors import UntrustedCheckpoint

UNKNOWN = "<a global computed at load time>"  # a STACK_GLOBAL the static read cannot name
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING",
            "SHORT_BINBYTES", "BINBYTES", "BINBYTES8"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_NOT_PUSHING = _PUTS | {"MEMOIZE", "PROTO", "FRAME", "STOP", "POP", "POP_MARK", "MARK"}


def pickle_globals(data: bytes) -> set[str]:
    """The ``module.name`` of every global the pickle ``data`` would import (``UNKNOWN`` for one that
    is not spelled out). What a ``STACK_GLOBAL`` takes is followed through the memo: protocol 4+
    writes the module and name as strings, often memoized and fetched back."""
    found: set[str] = set()
    proto = 0
    pushed: list = []  # what each opcode pushed, as far as a STACK_GLOBAL can need it (None: not a string)
    memo: dict = {}
    for op, arg, _ in pickletools.genops(io.BytesIO(data)):
        name = op.name
        if name == "PROTO":
            proto = arg
        elif name == "GLOBAL" or name == "INST":
            module, _, attr = str(arg).partition(" ")
            found.add(_python3_name(module, attr) if proto < 3 else f"{module}.{attr}")
            pushed.append(None)
        elif name == "STACK_GLOBAL":
            module, attr = (pushed[-2], pushed[-1]) if len(pushed) >= 2 else (None, None)
            ok = isinstance(module, str) and isinstance(attr, str)
            found.add(f"{module}.{attr}" if ok else UNKNOWN)
            pushed.append(None)
        elif name in _STRINGS:
            pushed.append(arg.decode("latin-1") if isinstance(arg, bytes) else arg)
        elif name in _GETS:
            pushed.append(memo.get(arg))
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in _PUTS:
            memo[arg] = pushed[-1] if pushed else None
        elif name not in _NOT_PUSHING:
            pushed.append(None)
    return found


def _python3_name(module: str, attr: str) -> str:
    """What the unpickler imports for a protocol 0-2 global (it maps Python 2 names, ``__builtin__`` ->
    ``builtins``, as ``pickle.Unpickler(fix_imports=True)`` and torch's loader do)."""
    import _compat_pickle

    if (module, attr) in _compat_pickle.NAME_MAPPING:
        module, attr = _compat_pickle.NAME_MAPPING[(module, attr)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{attr}"


def _zip_pickles(data: Union[bytes, Path]) -> list[bytes]:
    """The pickles of a ``torch.save`` zip: ``<archive>/data.pkl`` (and any other ``.pkl`` record)."""
    with zipfile.ZipFile(data if isinstance(data, Path) else io.BytesIO(data)) as z:
        return [z.read(n) for n in z.namelist() if n.endswith(".pkl")]


def globals_in_file(path: Union[str, Path]) -> set[str]:
    """What the pickles of ``path`` (a ``torch.save`` zip or a plain pickle) would import."""
    path = Path(path)
    if zipfile.is_zipfile(path):
        return set().union(*(pickle_globals(p) for p in _zip_pickles(path)))
    return pickle_globals(path.read_bytes())


_UNREADABLE = (ValueError, EOFError, zipfile.BadZipFile, KeyError, IndexError, OSError)


def scan(path: Union[str, Path], allowed=None, lists=None) -> list[str]:
    """The globals ``path`` would import that are not allowed for its name (sorted; [] = clean).
    Raises ``UntrustedCheckpoint`` for a file that cannot be read as a pickle (truncated, overwritten):
    what precedes the damage could still run, so it is not handed to a loader either."""
    path = Path(path)
    allowed = allowed_globals(path.name, lists) if allowed is None else allowed
    try:
        found = globals_in_file(path)
    except _UNREADABLE as exc:
        said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UntrustedCheckpoint(f"{path} cannot be read ({said}); the checkpoint is corrupt or was cut short, "
                                  f"and nothing of it was loaded: read an earlier tag (--tag, or point latest at "
                                  f"one)") from None
    return sorted(found - allowed)


def _refuse(path, bad: list[str], what: str = "") -> UntrustedCheckpoint:
    named = ", ".join(bad[:4]) + (f" (and {len(bad) - 4} more)" if len(bad) > 4 else "")
    return UntrustedCheckpoint(
        f"{path}{what} would import {named}"
        + ", which no checkpoint megafixed, DeepSpeed or DCP writes imports: unpickling it could run code, so "
          "nothing was loaded. Use a checkpoint you trust (or one exported as safetensors: megafixed export hf)")


def check_file(path: Union[str, Path], lists=None) -> None:
    bad = scan(path, lists=lists)
    if bad:
        raise _refuse(path, bad)


def check_tag_dir(tag_dir: Union[str, Path]) -> None:
    """Scan every pickle a loader of ``tag_dir`` would unpickle; raise ``UntrustedCheckpoint`` naming the
    first file and global outside the allow-lists. Nothing is unpickled before a file scanned clean."""
    tag_dir = Path(tag_dir)
    lists = allow_lists()
    # rglob: a universal checkpoint made beside it (<tag>/universal/, which a resume on another layout
    # hands to DeepSpeed) is read as well
    for path in sorted(p for p in tag_dir.rglob("*") if p.is_file() and pickled_file(p.name, lists)):
        check_file(path, lists)
    if (tag_dir / ".metadata").is_file():
        _check_dcp_byte_items(tag_dir, lists)


def _check_dcp_byte_items(tag_dir: Path, lists) -> None:
    """DCP stores non-tensor values (e.g. optimizer hyper-parameters) as ``torch.save`` bytes inside the
    ``.distcp`` shards and loads them with ``weights_only=False``; the (already scanned) ``.metadata``
    says where each one is."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = FileSystemReader(str(tag_dir)).read_metadata()
    allowed = allowed_globals("<dcp bytes item>", lists)
    root, inside = tag_dir.resolve(), {}
    for index, info in sorted((md.storage_data or {}).items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        if not isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        shard = tag_dir / info.relative_path
        if info.relative_path not in inside:
            inside[info.relative_path] = shard.resolve().parent == root
        if not inside[info.relative_path]:
            raise UntrustedCheckpoint(f"{tag_dir / '.metadata'} names '{info.relative_path}' for {index.fqn}, "
                                      f"outside the checkpoint directory; nothing was loaded")
        with open(shard, "rb") as fh:
            fh.seek(info.offset)
            blob = fh.read(info.length)
        try:
            found = set().union(*(pickle_globals(p) for p in _zip_pickles(blob))) if zipfile.is_zipfile(
                io.BytesIO(blob)) else pickle_globals(blob)
        except _UNREADABLE:
            found = {"<not a readable pickle>"}
        bad = sorted(found - allowed)
        if bad:
            raise _refuse(shard, bad, f" (its item {index.fqn})")


def load_weights(path: Union[str, Path], **kwargs):
    """``torch.load(path, weights_only=True)`` with the globals its file name's allow-lists name
    allowed (numpy's array reconstruction for the RNG states, ...); ``kwargs`` go to ``torch.load``
    (``map_location``, ``mmap``). A file that needs anything else fails in torch's unpickler, which
    names the global; nothing of it runs."""
    import torch

    safe = _resolve(allowed_globals(Path(path).name))
    with torch.serialization.safe_globals(safe):
        try:
            return torch.load(path, weights_only=True, **kwargs)
        except Exception as exc:
            if isinstance(exc, __import__("pickle").UnpicklingError) and "weights_only" in str(exc):
                bad = scan(path) or ["a global outside the allow-list"]
                raise _refuse(path, bad) from None
            raise


def _resolve(names) -> list:
    """``(object, name)`` for each allowed class or function (torch matches the name as written in
    the pickle). A name this install lacks (numpy 1's ``numpy.core`` under numpy 2) is skipped:
    nothing could import it either; dtypes and storages are not callables torch needs listed."""
    import importlib
    import sys

    out = []
    for name in sorted(names):
        module, _, attr = name.rpartition(".")
        if module.split(".")[0] not in sys.modules:
            # a library not loaded (DeepSpeed in `megafixed eval`): its classes are in no file these
            # readers load (the optimizer partitions), and importing it would cost seconds
            continue
        try:
            obj = importlib.import_module(module)
        except ImportError:
            # a class attribute (``module.Class.attr``): import the module, then walk the attributes
            head, _, cls = module.rpartition(".")
            try:
                obj = getattr(importlib.import_module(head), cls)
            except (ImportError, AttributeError):
                continue
        obj = getattr(obj, attr, None)
        if callable(obj) and hasattr(obj, "__qualname__"):
            out.append((obj, name))
    return out
