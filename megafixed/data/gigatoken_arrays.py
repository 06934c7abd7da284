"""gigatoken's batch encode as two numpy arrays (flat ids, per-document lengths), without awkward.

gigatoken 0.10's ``encode_batch`` computes exactly those two arrays in Rust and then hands them to
``awkward.unflatten`` to return an ``ak.Array``, which preprocessing immediately takes apart again.
Importing awkward (it pulls in pyarrow and fsspec) costs 0.3-0.45 CPU-seconds: a third of a whole
30 MB preprocessing run on 2 cores, spent before the first token. So while our own call runs, and
only if nothing in the process has imported awkward, a stand-in module sits in ``sys.modules``
whose ``unflatten`` returns the two arrays as they are.

Kept safe three ways: the stand-in answers only the thread that is inside :func:`encode_flat`; any
other use of it (another thread's ``import awkward``, a gigatoken version that asks awkward for
anything else) imports the real awkward, puts it in ``sys.modules`` and answers with that; and
whatever gigatoken returns that is not the stand-in's own result (a real ``ak.Array``) is read
through awkward as before. The result is checked for shape either way, so a changed gigatoken
costs at most the import, never an id.
"""
from __future__ import annotations

import importlib
import sys
import threading
import types

import numpy as np

# The encode_batch -> awkward.unflatten call this stands in for, as this version makes it
# (tests/test_startup_imports.py fails on another minor version, tests/test_gigatoken_arrays.py on another call)
WRITTEN_AGAINST = ("gigatoken", "0.10.0")
_LOCK = threading.RLock()
_LOCAL = threading.local()  # .active: this thread is inside encode_flat
_USERS = 0  # threads inside encode_flat with the stand-in installed


class _NotAnAwkwardArray:
    """What ``awkward.Array`` is to gigatoken's input check (``isinstance(inputs, ak.Array)``)
    during our call: a class no input is an instance of, since we pass a list of str."""


class _Flat(tuple):
    """(flat ids, lengths) as the stand-in's ``unflatten`` got them from gigatoken."""


def _unflatten(flat, counts, *args, **kwargs):
    if args or kwargs:  # not the call gigatoken 0.10 makes: let awkward answer it
        return _real_awkward().unflatten(flat, counts, *args, **kwargs)
    return _Flat((flat, counts))


def _real_awkward():
    """The real awkward, imported now, and put in ``sys.modules`` in place of the stand-in."""
    with _LOCK:
        if sys.modules.get("awkward") is _STAND_IN:
            del sys.modules["awkward"]
        return importlib.import_module("awkward")


class _StandIn(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):  # module protocol lookups (__path__, __spec__, ...): no such thing here
            raise AttributeError(name)
        if getattr(_LOCAL, "active", False) and name in ("Array", "unflatten"):
            return _NotAnAwkwardArray if name == "Array" else _unflatten
        return getattr(_real_awkward(), name)


_STAND_IN = _StandIn("awkward", "megafixed's stand-in for awkward during gigatoken's batch encode")


def encode_flat(backend, texts: list, parallel: bool) -> tuple[np.ndarray, np.ndarray]:
    """``backend.encode_batch(texts, parallel=...)`` (a gigatoken backend) -> (flat uint32 ids,
    int64 lengths), the flat array covering exactly the documents in order."""
    global _USERS
    with _LOCK:
        mine = "awkward" not in sys.modules or sys.modules["awkward"] is _STAND_IN
        if mine:
            sys.modules["awkward"] = _STAND_IN
            _USERS += 1
    _LOCAL.active = True
    try:
        got = backend.encode_batch(texts, parallel=parallel)
    finally:
        _LOCAL.active = False
        if mine:
            with _LOCK:
                _USERS -= 1
                if _USERS == 0 and sys.modules.get("awkward") is _STAND_IN:
                    del sys.modules["awkward"]
    if isinstance(got, _Flat):
        flat, lengths = np.asarray(got[0]), np.asarray(got[1], dtype=np.int64)
        start = 0
    else:  # a real ak.Array (awkward was imported already, or gigatoken built it otherwise)
        import awkward as ak

        layout = ak.to_layout(got)
        offsets = np.asarray(layout.offsets.data, dtype=np.int64)
        flat, lengths, start = np.asarray(layout.content.data), np.diff(offsets), int(offsets[0])
    end = start + int(lengths.sum())
    if flat.ndim != 1 or len(lengths) != len(texts) or flat.size < end or (lengths < 0).any():
        raise ValueError(f"gigatoken returned {flat.shape} ids with {len(lengths)} lengths for {len(texts)} texts")
    return flat[start:end], lengths
