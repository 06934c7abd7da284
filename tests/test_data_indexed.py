"""Megatron .bin/.idx: byte compatibility with megatron-core both ways, uint16 at 65,536, error paths."""
from __future__ import annotations

import os
import struct
import warnings

import numpy as np
import pytest

from megafixed.data.errors import ShardError
from megafixed.data.indexed import (
    IndexedShard,
    ShardWriter,
    bin_path,
    dtype_for_vocab,
    idx_path,
    merge_shards,
    shard_exists,
)


@pytest.fixture(scope="module")
def megatron_indexed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def _docs(seed=0, n=50, vocab=5000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 300))) for _ in range(n)]


def _write(prefix, docs, dtype=np.uint16):
    with ShardWriter(prefix, dtype) as w:
        for d in docs[:10]:
            w.add_document(d)
        rest = docs[10:]  # and the batched path
        if rest:
            w.add_documents(np.concatenate(rest), np.array([len(d) for d in rest]))
        w.finalize()


def test_megatron_reads_our_shard(tmp_path, megatron_indexed):
    docs = _docs()
    prefix = str(tmp_path / "ours")
    _write(prefix, docs)
    ds = megatron_indexed.IndexedDataset(prefix)
    assert len(ds) == len(docs)
    assert ds.index.dtype == np.uint16
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(docs) + 1))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    # and the header bytes are exactly the spec's
    head = open(idx_path(prefix), "rb").read(34)
    assert head[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<QBQQ", head[9:]) == (1, 8, len(docs), len(docs) + 1)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # megatron-core's numpy.array(tensor, copy=...)
@pytest.mark.parametrize("dtype", [np.int32, np.uint16])
def test_we_read_megatron_builder_shard(tmp_path, megatron_indexed, dtype):
    import torch

    docs = _docs(1)
    prefix = str(tmp_path / "theirs")
    b = megatron_indexed.IndexedDatasetBuilder(bin_path(prefix), dtype=dtype)
    for d in docs[:-1]:
        b.add_document(torch.from_numpy(d.astype(np.int64)), [len(d)])
    last = docs[-1]  # a multi-sequence document
    b.add_item(torch.from_numpy(last[:5].astype(np.int64)))
    b.add_item(torch.from_numpy(last[5:].astype(np.int64)))
    b.end_document()
    b.finalize(idx_path(prefix))
    shard = IndexedShard(prefix)
    assert shard.dtype == np.dtype(dtype)
    assert shard.num_documents == len(docs) and shard.num_sequences == len(docs) + 1
    assert shard.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(shard.document(i), d)


def test_vocab_65536_is_uint16_and_top_id_survives(tmp_path, megatron_indexed):
    assert dtype_for_vocab(65536) == np.uint16 and dtype_for_vocab(65537) == np.int32
    prefix = str(tmp_path / "big")
    doc = np.array([65535, 0, 65534, 1, 65535])
    _write(prefix, [doc], dtype=dtype_for_vocab(65536))
    assert IndexedShard(prefix).dtype == np.uint16
    np.testing.assert_array_equal(IndexedShard(prefix)[0], doc)
    theirs = megatron_indexed.IndexedDataset(prefix)  # keep it alive: its __del__ closes the mmap
    np.testing.assert_array_equal(theirs[0], doc)
    with ShardWriter(str(tmp_path / "over"), np.uint16) as w:
        with pytest.raises(ShardError, match="65536 does not fit uint16"):
            w.add_document([65536])


def _corrupt(prefix, which, mutate):
    path = idx_path(prefix) if which == "idx" else bin_path(prefix)
    data = bytearray(open(path, "rb").read())
    open(path, "wb").write(bytes(mutate(data)))
    return path


@pytest.mark.parametrize("which,mutate,message", [
    ("bin", lambda b: b[:-3], r"\.bin is truncated"),
    ("bin", lambda b: b + b"\0\0", r"bytes more than"),
    ("idx", lambda b: b"XXIDIDX\x00\x00" + b[9:], r"not a Megatron index"),
    ("idx", lambda b: b[:-8], r"is .* bytes but its header"),
    ("idx", lambda b: b[:40], r"is .* bytes but its header"),
    ("idx", lambda b: b[:10], r"truncated .* header"),
    ("idx", lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], r"version 2"),
    ("idx", lambda b: b[:17] + bytes([6]) + b[18:], r"dtype code 6"),
    ("idx", lambda b: b[:34] + struct.pack("<i", 7) + b[38:], r"not contiguous|bytes more|truncated"),
])
def test_corrupt_shards_are_refused_naming_the_file(tmp_path, which, mutate, message):
    prefix = str(tmp_path / "s")
    _write(prefix, _docs(2, n=20))
    path = _corrupt(prefix, which, mutate)
    with pytest.raises(ShardError, match=message) as err:
        IndexedShard(prefix)
    assert path in str(err.value)


def test_missing_file_and_aborted_writer(tmp_path):
    with pytest.raises(ShardError, match="not found; run `megafixed preprocess"):
        IndexedShard(str(tmp_path / "nothing"))
    prefix = str(tmp_path / "aborted")
    with pytest.raises(KeyboardInterrupt):
        with ShardWriter(prefix, np.uint16) as w:
            w.add_document([1, 2, 3])
            raise KeyboardInterrupt  # Ctrl-C mid-write
    assert os.listdir(tmp_path) == []  # no temp file, and certainly no complete-looking pair
    assert not shard_exists(prefix)


def test_rewrite_never_pairs_old_index_with_new_bin(tmp_path):
    prefix = str(tmp_path / "r")
    _write(prefix, _docs(3, n=5))
    w = ShardWriter(prefix, np.uint16)
    w.add_document([9, 9, 9])
    w.finalize()
    shard = IndexedShard(prefix)
    assert shard.num_documents == 1 and shard[0].tolist() == [9, 9, 9]


def test_merge_matches_concatenation_and_widens(tmp_path, megatron_indexed):
    a, b = _docs(4, n=7), _docs(5, n=9, vocab=70000)
    _write(str(tmp_path / "a"), a, np.uint16)
    _write(str(tmp_path / "b"), b, np.int32)
    info = merge_shards([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "m"))
    assert info["dtype"] == "int32" and info["documents"] == 16
    theirs = megatron_indexed.IndexedDataset(str(tmp_path / "m"))
    for i, d in enumerate(a + b):
        np.testing.assert_array_equal(theirs[i], d)


def test_merge_refuses_shards_from_different_tokenizers(tmp_path):
    import json

    from megafixed.data.indexed import meta_path
    for name, tok in (("a", {"type": "hf", "path": "/x/one.json"}), ("b", {"type": "hf", "path": "/x/two.json"})):
        _write(str(tmp_path / name), _docs(1, n=3))
        with open(meta_path(str(tmp_path / name)), "w") as fh:
            json.dump({"tokenizer": tok}, fh)
    with pytest.raises(ShardError, match="different tokenizers"):
        merge_shards([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "m"))
    assert not shard_exists(str(tmp_path / "m")) and not os.listdir(tmp_path).count("m.bin")
