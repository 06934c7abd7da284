"""prepare_data: first-use tokenizer training + tokenization, caching, staleness, multi-rank, vocab checks."""
from __future__ import annotations

import gzip
import itertools
import json
import os
import threading

import numpy as np
import pytest

from megafixed.config import load_config
from megafixed.data import BUNDLED_CORPUS
from megafixed.data.errors import DataError, VocabError
from megafixed.data.gpt_dataset import build_datasets
from megafixed.data.indexed import IndexedShard, bin_path, idx_path
from megafixed.data.prepare import prepare_data
from megafixed.data.tokenizers import load_tokenizer

SMALL_MODEL = ["model.d_model=64", "model.n_heads=4", "model.n_layers=1", "model.max_seq_len=64", "data.seq_len=32"]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl.gz"
    with gzip.open(BUNDLED_CORPUS, "rb") as src, gzip.open(path, "wb") as dst:
        dst.writelines(itertools.islice(src, 300))
    return path


def _cfg(source, *extra, validate=True):
    return load_config(None, [f"data.source={source}", "data.tokenizer_train_vocab=512", "model.vocab_size=512",
                              "model.code_bits=9", *SMALL_MODEL, *extra], validate=validate)


@pytest.mark.parametrize("tokenizer", [None, "sp.model"])
def test_first_use_then_cached(corpus, tmp_path, monkeypatch, tokenizer):
    monkeypatch.chdir(tmp_path)  # relative paths are relative to the cwd
    extra = [f"data.tokenizer={tokenizer}"] if tokenizer else []
    cfg = prepare_data(_cfg("corpus.jsonl.gz", *extra), progress=False)
    d = cfg.data
    assert os.path.isabs(d.tokenizer) and os.path.isabs(d.prefixes[0])
    if tokenizer is None:  # the user cache (MEGAFIXED_CACHE_DIR), keyed by the source's path; never next to it
        from megafixed.data.prepare import _default_cache

        cache = _default_cache([str(tmp_path / "corpus.jsonl.gz")])
        assert cache.startswith(os.environ["MEGAFIXED_CACHE_DIR"]) and not (tmp_path / "cache").exists()
        assert d.tokenizer == os.path.join(cache, "corpus.tok512.json")
        assert d.prefixes == [os.path.join(cache, "corpus.tok512")]
    tok = load_tokenizer(d.tokenizer)
    assert tok.vocab_size == 512
    with gzip.open(corpus, "rt") as fh:
        first = json.loads(fh.readline())["text"]
    shard = IndexedShard(d.prefixes[0])
    assert shard.num_documents == 300
    assert shard.document(0).tolist() == tok.encode(first) + [tok.eod_id]
    stamps = [os.stat(p).st_mtime_ns for p in (d.tokenizer, bin_path(d.prefixes[0]), idx_path(d.prefixes[0]))]
    again = prepare_data(_cfg("corpus.jsonl.gz", *extra), progress=False)  # cached: nothing rewritten
    assert again.data.prefixes == d.prefixes
    assert stamps == [os.stat(p).st_mtime_ns for p in (d.tokenizer, bin_path(d.prefixes[0]), idx_path(d.prefixes[0]))]
    assert len(build_datasets(cfg.data, seed=0)["train"]) > 0


def test_changed_source_is_retokenized(corpus, tmp_path):
    cfg = prepare_data(_cfg(corpus), progress=False)
    with gzip.open(corpus, "ab") as fh:
        fh.write(json.dumps({"text": "One more document at the end."}).encode() + b"\n")
    cfg2 = prepare_data(_cfg(corpus), progress=False)
    assert IndexedShard(cfg2.data.prefixes[0]).num_documents == 301
    assert cfg2.data.tokenizer == cfg.data.tokenizer


def test_non_main_ranks_wait_for_the_main_one(corpus):
    results = {}

    def rank(r):
        results[r] = prepare_data(_cfg(corpus), is_main=(r == 0), poll_s=0.05, wait_timeout_s=120, progress=False)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1, 2]
    assert results[1].data.prefixes == results[0].data.prefixes == results[2].data.prefixes
    np.testing.assert_array_equal(IndexedShard(results[1].data.prefixes[0]).lengths,
                                  IndexedShard(results[0].data.prefixes[0]).lengths)


def test_non_main_times_out_with_a_clear_error(corpus):
    with pytest.raises(DataError, match="waited 0s for the main process"):
        prepare_data(_cfg(corpus), is_main=False, wait_timeout_s=0.2, poll_s=0.05)


def test_vocab_checks(corpus):
    prepare_data(_cfg(corpus), progress=False)  # trains the 512-token tokenizer
    with pytest.raises(VocabError, match=r"has 512 tokens but model.vocab_size=500; set model.vocab_size>=512"):
        prepare_data(_cfg(corpus, "model.vocab_size=500"), progress=False)
    # fixed codes: 8 bits hold 256 ids (config validation is skipped to reach prepare_data's own check)
    bad = _cfg(corpus, "model.code_bits=8", validate=False)
    with pytest.raises(VocabError,
                       match=r"512 tokens but 8-bit fixed codes hold only 256.*model.code_bits.*at least 9"):
        prepare_data(bad, progress=False)
    learned = _cfg(corpus, "model.code_bits=8", "model.input=learned", validate=False)
    prepare_data(learned, progress=False)  # a learned table has no code-bit limit


def test_missing_inputs(tmp_path):
    with pytest.raises(DataError, match="matches no file"):
        prepare_data(_cfg(tmp_path / "nope.jsonl"))
    cfg = load_config(None, SMALL_MODEL + [f"data.prefixes=[{tmp_path / 'nope'}]"])
    with pytest.raises(DataError, match="no shards for data prefix"):
        prepare_data(cfg)
    with pytest.raises(DataError, match="no data"):
        prepare_data(load_config(None, SMALL_MODEL))


def test_source_never_overwrites_shards_it_did_not_write(corpus, tmp_path):
    # `data.prefixes=mine` over a config with data.source used to re-tokenize the source INTO the
    # user's own shards, destroying them.
    from megafixed.data.indexed import ShardWriter
    mine = str(tmp_path / "mine")
    with ShardWriter(mine, np.uint16) as w:
        w.add_document([1, 2, 3])
        w.finalize({"vocab_size": 512})
    before = open(bin_path(mine), "rb").read()
    with pytest.raises(DataError, match=r"holds shards that were not tokenized from data\.source.*data\.source=null"):
        prepare_data(_cfg(corpus, f"data.prefixes=[{mine}]"), progress=False)
    assert open(bin_path(mine), "rb").read() == before


def test_shards_without_a_recorded_vocab_are_scanned_for_out_of_range_ids(tmp_path):
    # Foreign shards (no vocab_size in .meta.json) with an id past model.vocab_size used to fail
    # mid-run with an IndexError traceback from the embedding (a device assert on GPU).
    from megafixed.data.indexed import ShardWriter
    prefix = str(tmp_path / "foreign")
    with ShardWriter(prefix, np.uint16) as w:
        w.add_document([5, 999, 7])
        w.finalize({})
    cfg = load_config(None, SMALL_MODEL + [f"data.prefixes=[{prefix}]", "model.input=learned", "model.vocab_size=256"])
    with pytest.raises(VocabError, match=r"largest token id 999\) has 1000 tokens but model\.vocab_size=256"):
        prepare_data(cfg)
    prepare_data(load_config(None, SMALL_MODEL + [f"data.prefixes=[{prefix}]", "model.input=learned",
                                                 "model.vocab_size=1000"]))  # fits: no error


def test_a_tokenizer_too_big_for_the_model_is_refused_before_training(corpus, tmp_path):
    # It used to train the tokenizer and tokenize the whole corpus first, then refuse.
    cfg = _cfg(corpus, "data.tokenizer_train_vocab=70000", f"data.cache_dir={tmp_path / 'cache70'}")
    with pytest.raises(VocabError, match=r"data\.tokenizer_train_vocab .* has 70000 tokens but model\.vocab_size=512"):
        prepare_data(cfg, progress=False)
    assert not (tmp_path / "cache70").exists()
