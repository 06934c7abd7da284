"""GPT training dataset: text -> shards -> samples -> text, splits, epochs, exact resume, DP, blending, cache."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megafixed.data.errors import DataError, ShardError
from megafixed.data.gpt_dataset import build_datasets, micro_batches
from megafixed.data.indexed import ShardWriter, bin_path


def _cfg(prefixes, seq_len=16, split="80,10,10", weights=None, cache_dir=None):
    return SimpleNamespace(prefixes=[str(p) for p in prefixes], weights=weights, seq_len=seq_len, split=split,
                           cache_dir=cache_dir)


def _write(prefix, docs, eod=None):
    with ShardWriter(str(prefix), np.uint16) as w:
        for d in docs:
            w.add_document(list(d) + ([eod] if eod is not None else []))
        w.finalize()


def _synthetic_docs(n=100, seed=0, base=1):
    """Documents whose tokens say where they come from: doc i holds base + i repeated, then a counter."""
    rng = np.random.default_rng(seed)
    return [[base * 1000 + i] + list(range(int(rng.integers(3, 40)))) for i in range(n)]


def test_round_trip_text_to_samples_to_text(tmp_path):
    from megafixed.data.preprocess import PreprocessOptions, preprocess
    from megafixed.data.tokenizers import load_tokenizer, train_tokenizer

    texts = [f"Document number {i} talks about {'cats' if i % 2 else 'dogs'} and the number {i * 7}."
             for i in range(60)]
    (tmp_path / "c.txt").write_text("\n\n".join(texts) + "\n")
    tok_path = train_tokenizer([str(tmp_path / "c.txt")], str(tmp_path / "t.json"), 320)
    preprocess(PreprocessOptions([str(tmp_path / "c.txt")], str(tmp_path / "c"), tok_path, progress=False))
    tok = load_tokenizer(tok_path)
    seq = 8
    ds = build_datasets(_cfg([tmp_path / "c"], seq_len=seq, split="1,0,0"), seed=3)
    train = ds["train"]
    assert ds["valid"] is None and ds["test"] is None
    # the reference stream: tokenizer output of each document + EOD, concatenated
    stream = np.concatenate([tok.encode(t) + [tok.eod_id] for t in texts])
    assert len(train) == (len(stream) - 1) // seq
    windows = {}
    for idx in range(len(train)):
        comp, s = train.locate(idx)
        windows[s] = train[idx]
        np.testing.assert_array_equal(windows[s], stream[s * seq: s * seq + seq + 1])
    assert sorted(windows) == list(range(len(train)))  # one epoch = every window exactly once
    text = tok.decode(np.concatenate([windows[s][:-1] for s in range(len(train))]))
    assert text.split("<|endoftext|>")[:-1] == texts[: len(text.split("<|endoftext|>")) - 1]
    assert text.startswith(texts[0] + "<|endoftext|>" + texts[1])


def test_split_by_documents(tmp_path):
    docs = _synthetic_docs(100)
    _write(tmp_path / "d", docs)
    ds = build_datasets(_cfg([tmp_path / "d"], seq_len=4, split="80,10,10"), seed=0)
    for name, (d0, d1) in {"train": (0, 80), "valid": (80, 90), "test": (90, 100)}.items():
        stream = np.concatenate(docs[d0:d1])
        got = ds[name]
        assert got.num_tokens == len(stream)
        for idx in range(len(got)):
            _, s = got.locate(idx)
            np.testing.assert_array_equal(got[idx], stream[s * 4: s * 4 + 5])
    assert build_datasets(_cfg([tmp_path / "d"], split="100,0,0"), seed=0)["valid"] is None


def test_epochs_wrap_with_their_own_order(tmp_path):
    _write(tmp_path / "d", _synthetic_docs(50))
    cfg = _cfg([tmp_path / "d"], seq_len=8, split="1,0,0")
    ds = build_datasets(cfg, seed=7)["train"]
    n = len(ds)
    e0 = [ds.locate(i)[1] for i in range(n)]
    e1 = [ds.locate(n + i)[1] for i in range(n)]
    assert sorted(e0) == sorted(e1) == list(range(n)) and e0 != e1
    again = build_datasets(cfg, seed=7)["train"]
    assert [again.locate(i)[1] for i in range(2 * n)] == e0 + e1  # reproducible from (seed, epoch)
    other = build_datasets(cfg, seed=8)["train"]
    assert [other.locate(i)[1] for i in range(n)] != e0
    np.testing.assert_array_equal(ds[5 * n + 3], again[5 * n + 3])


def test_exact_resume_and_any_dp_layout(tmp_path):
    _write(tmp_path / "d", _synthetic_docs(10))
    ds = build_datasets(_cfg([tmp_path / "d"], seq_len=8, split="1,0,0"), seed=1)["train"]
    gb, steps = 6, 9  # a global batch of 6 samples, run long enough to cross an epoch
    assert steps * gb > len(ds)
    single = micro_batches(ds, 0, gb, 0, 1)
    reference = [next(single) for _ in range(steps)]
    assert all(b.dtype == torch.int64 and b.shape == (gb, 9) for b in reference)
    for dp, mb in ((2, 3), (3, 2), (6, 1)):
        its = [micro_batches(ds, 0, mb, r, dp) for r in range(dp)]
        for step in range(steps):
            torch.testing.assert_close(torch.cat([next(it) for it in its]), reference[step], rtol=0, atol=0)
    # resume after 4 steps from consumed_samples = 4 * gb, with a different DP layout
    its = [micro_batches(ds, 4 * gb, 2, r, 3) for r in range(3)]
    for step in range(4, steps):
        torch.testing.assert_close(torch.cat([next(it) for it in its]), reference[step], rtol=0, atol=0)
    # DataLoader workers prefetch but keep the order
    loader = micro_batches(ds, 4 * gb, gb, 0, 1, num_workers=2)
    for step in range(4, 6):
        torch.testing.assert_close(next(loader), reference[step], rtol=0, atol=0)
    with pytest.raises(DataError, match="dp_rank"):
        micro_batches(ds, 0, 2, 3, 2)  # refused at the call, not at the first batch


def test_blending_ratios_and_cache(tmp_path):
    _write(tmp_path / "a", _synthetic_docs(300, seed=1, base=1))
    _write(tmp_path / "b", _synthetic_docs(60, seed=2, base=2))
    cfg = _cfg([tmp_path / "a", tmp_path / "b"], seq_len=4, split="1,0,0", weights=[1, 3])
    ds = build_datasets(cfg, seed=0)["train"]
    comps = np.array([ds.locate(i)[0] for i in range(3 * len(ds))])
    assert abs(comps[: len(ds)].mean() - 0.75) < 1.0 / len(ds) + 1e-9  # exact per epoch
    for lo in range(0, 3 * len(ds) - 400, 400):  # and every stretch of 400 samples within 1 of 3:1
        assert abs((comps[lo: lo + 400] == 1).sum() - 300) <= 1
    # the samples of each component really come from that prefix
    for i in range(50):
        c, _ = ds.locate(i)
        assert ds.components[c].name.startswith(str(tmp_path / ("a" if c == 0 else "b")))
    caches = [f for f in os.listdir(tmp_path) if f.endswith(".blend.json")]
    assert len(caches) == 1
    cache = tmp_path / caches[0]
    stamp = 10**18  # an mtime no write sets (2001-09-09): a rewrite shows however coarse the clock is
    os.utime(cache, ns=(stamp, stamp))
    build_datasets(cfg, seed=0)  # cached: the index is not rebuilt
    assert os.stat(cache).st_mtime_ns == stamp
    b = os.stat(bin_path(str(tmp_path / "b")))
    os.utime(bin_path(str(tmp_path / "b")), ns=(b.st_atime_ns, b.st_mtime_ns + 10**9))  # the shard changed
    ds2 = build_datasets(cfg, seed=0)["train"]
    assert os.stat(cache).st_mtime_ns != stamp
    np.testing.assert_array_equal(ds2[17], ds[17])
    # data.cache_dir puts the cache elsewhere
    build_datasets(_cfg(cfg.prefixes, seq_len=4, split="1,0,0", weights=[1, 3], cache_dir=str(tmp_path / "cc")), seed=0)
    assert any(f.endswith(".blend.json") for f in os.listdir(tmp_path / "cc"))


def test_sharded_prefix_equals_single_shard(tmp_path):
    docs = _synthetic_docs(40)
    _write(tmp_path / "one", docs)
    for k, part in enumerate((docs[:13], docs[13:14], docs[14:])):
        _write(tmp_path / f"set_{k:05d}", part)
    a = build_datasets(_cfg([tmp_path / "one"], seq_len=5, split="90,5,5"), seed=2)
    b = build_datasets(_cfg([tmp_path / "set"], seq_len=5, split="90,5,5"), seed=2)
    for name in ("train", "valid", "test"):
        assert len(a[name]) == len(b[name])
        for i in range(len(a[name])):
            np.testing.assert_array_equal(a[name][i], b[name][i])


def test_errors(tmp_path):
    with pytest.raises(DataError, match="no shards for data prefix .*megafixed preprocess"):
        build_datasets(_cfg([tmp_path / "nope"]), seed=0)
    with pytest.raises(DataError, match="data.prefixes is empty"):
        build_datasets(_cfg([]), seed=0)
    _write(tmp_path / "tiny", [[1, 2, 3]])
    with pytest.raises(DataError, match="no sample of seq_len\\+1=17 tokens"):
        build_datasets(_cfg([tmp_path / "tiny"]), seed=0)
    _write(tmp_path / "d", _synthetic_docs(20))
    with open(bin_path(str(tmp_path / "d")), "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(ShardError, match=r"d\.bin is truncated"):
        build_datasets(_cfg([tmp_path / "d"]), seed=0)
