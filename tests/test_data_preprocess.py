"""Preprocessing: worker-count determinism, every input format, bad input, sharding, CLI, 65,536 vocab."""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os

import pytest

from megafixed.data import BUNDLED_CORPUS
from megafixed.data.errors import DataError, VocabError
from megafixed.data.indexed import IndexedShard, bin_path, idx_path
from megafixed.data.prefixes import resolve_prefix
from megafixed.data.preprocess import PreprocessOptions, preprocess
from megafixed.data.tokenizers import load_tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def texts():
    with gzip.open(BUNDLED_CORPUS, "rt") as fh:
        return [json.loads(line)["text"] for line in itertools.islice(fh, 600)]


@pytest.fixture(scope="module")
def data(tmp_path_factory, texts):
    root = tmp_path_factory.mktemp("pre")
    jsonl = root / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    tok = train_tokenizer([str(jsonl)], str(root / "tok.json"), 512)
    return root, str(jsonl), tok


def _run(inputs, prefix, tok, **kw):
    kw.setdefault("progress", False)
    return preprocess(PreprocessOptions(inputs=list(inputs), output_prefix=str(prefix), tokenizer=tok, **kw))


def _docs(prefix):
    out = []
    for p in resolve_prefix(str(prefix)):
        s = IndexedShard(p)
        out += [s.document(i).tolist() for i in range(s.num_documents)]
    return out


def test_documents_are_the_tokenizer_output_plus_eod(data, texts):
    root, jsonl, tok_path = data
    rep = _run([jsonl], root / "ref", tok_path)
    tok = load_tokenizer(tok_path)
    expected = [tok.encode(t) + [tok.eod_id] for t in texts]  # independent: tokenizer called directly
    assert _docs(root / "ref") == expected
    assert rep.documents == len(texts) and rep.tokens == sum(map(len, expected))
    meta = IndexedShard(str(root / "ref")).meta()
    assert meta["tokenizer"] == load_tokenizer(tok_path).describe() and meta["append_eod"] is True
    no_eod = _run([jsonl], root / "noeod", tok_path, append_eod=False)
    assert _docs(root / "noeod") == [d[:-1] for d in expected] and no_eod.tokens == rep.tokens - len(texts)


def test_identical_bytes_for_1_and_3_workers(data):
    root, jsonl, tok = data
    _run([jsonl], root / "w1", tok, workers=1, batch_records=32)
    _run([jsonl], root / "w3", tok, workers=3, batch_records=32)
    for path in (bin_path, idx_path):
        assert open(path(str(root / "w1")), "rb").read() == open(path(str(root / "w3")), "rb").read()


def test_compressed_and_parquet_inputs_match_plain_jsonl(data, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root, jsonl, tok = data
    raw = open(jsonl, "rb").read()
    with gzip.open(root / "c.jsonl.gz", "wb") as fh:
        fh.write(raw)
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    # several row groups: the reader must stream them in order
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), root / "c.parquet", row_group_size=97)
    ref = _docs(_run([jsonl], root / "plain", tok).outputs["text"][0])
    for name in ("c.jsonl.gz", "c.jsonl.zst", "c.parquet"):
        assert _docs(_run([str(root / name)], root / name.replace(".", "_"), tok, workers=2).outputs["text"][0]) == ref


def test_plain_text_paragraphs(data):
    root, _, tok_path = data
    (root / "a.txt").write_text("First paragraph,\nstill first.\n\n\nSecond one.\n")
    tok = load_tokenizer(tok_path)
    _run([str(root / "a.txt")], root / "txt", tok_path)
    got = [tok.decode(d[:-1]) for d in _docs(root / "txt")]
    assert got == ["First paragraph,\nstill first.", "Second one."]


def test_bad_records_are_counted_and_never_shift_documents(data):
    root, _, tok_path = data
    good = ["alpha beta", "gamma", "delta epsilon"]
    lines = [json.dumps({"text": good[0]}).encode(), b'{"text": "bad \xff\xfe bytes"}',
             json.dumps({"body": "x"}).encode(),
             json.dumps({"text": ""}).encode(), b"{not json", json.dumps({"text": good[1]}).encode(),
             json.dumps({"text": 5}).encode(), b"", json.dumps({"text": good[2]}).encode()]
    (root / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    rep = _run([str(root / "bad.jsonl")], root / "bad", tok_path, workers=2, batch_records=2)
    tok = load_tokenizer(tok_path)
    assert _docs(root / "bad") == [tok.encode(t) + [tok.eod_id] for t in good]
    assert rep.bad == {"undecodable": 1, "bad_json": 1, "missing_key": 1, "bad_type": 1, "empty": 1, "too_long": 0}
    assert rep.blank_lines == 1 and any("bad.jsonl:2" in e for e in rep.bad_examples)
    assert "skipped bad records" in rep.summary()
    strict_in = root / "in_strict.jsonl"
    strict_in.write_text("".join(json.dumps(r) + "\n" for r in ({"text": "fine"}, {"text": "ok"}, {"body": "x"})))
    with pytest.raises(DataError, match=r"in_strict\.jsonl:3: key 'text' missing.*--strict"):
        _run([str(strict_in)], root / "strict", tok_path, strict=True, workers=2, batch_records=1)
    assert not os.path.exists(idx_path(str(root / "strict")))  # an aborted run leaves no shard
    assert not [p for p in os.listdir(root) if p.startswith("strict")]


def test_a_wrong_json_key_that_skips_every_record_is_an_error_and_writes_nothing(data):
    # Every record lacking the key used to give rc 0 and an empty shard that only failed at training.
    root, jsonl, tok_path = data
    with pytest.raises(DataError, match=r"no document written: every record was skipped.*'missing_key': 600.*"
                                        r"key 'body' missing.*check --json-keys body"):
        _run([jsonl], root / "wrongkey", tok_path, json_keys=["body"], workers=2)
    assert not [p for p in os.listdir(root) if p.startswith("wrongkey")]
    # An empty corpus used to write an empty shard (rc 0) that only failed at training time.
    (root / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"no document written: the inputs .*empty\.jsonl.* hold no text"):
        _run([str(root / "empty.jsonl")], root / "emptyout", tok_path)
    assert not [p for p in os.listdir(root) if p.startswith("emptyout")]


def test_shards_by_size_concatenate_to_the_unsharded_output(data):
    root, jsonl, tok = data
    full = _docs(_run([jsonl], root / "one", tok).outputs["text"][0])
    rep = _run([jsonl], root / "sh", tok, shard_size_mb=0.05, workers=2)
    shards = rep.outputs["text"]
    assert len(shards) > 2 and shards == resolve_prefix(str(root / "sh"))
    assert _docs(root / "sh") == full
    for p in shards[:-1]:  # every shard but the last is filled to the limit (give or take one document)
        assert os.path.getsize(bin_path(p)) <= 0.05 * 2 ** 20
    # re-running with bigger shards leaves no stale extra shard behind
    rep2 = _run([jsonl], root / "sh", tok, shard_size_mb=0.2)
    assert resolve_prefix(str(root / "sh")) == rep2.outputs["text"] and len(rep2.outputs["text"]) < len(shards)
    assert _docs(root / "sh") == full


def test_vocab_65536_through_preprocessing(tmp_path):
    """A 65,536-id tokenizer (word level, built by hand) writes uint16 and keeps id 65535."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, 65536)}}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.save(str(tmp_path / "wl.json"))
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "w65535 w1 w65534"}) + "\n")
    rep = _run([str(tmp_path / "in.jsonl")], tmp_path / "wl", str(tmp_path / "wl.json"), code_bits=16)
    assert rep.dtype == "uint16"
    assert IndexedShard(str(tmp_path / "wl")).document(0).tolist() == [65535, 1, 65534, 0]
    with pytest.raises(VocabError, match=r"65536 tokens but 15-bit fixed codes hold only 32768.*at least 16"):
        _run([str(tmp_path / "in.jsonl")], tmp_path / "wl15", str(tmp_path / "wl.json"), code_bits=15)


def test_cli_multiple_keys_and_inspect(data, capsys):
    from megafixed.commands import data as data_cmd
    from megafixed.commands import preprocess as pre_cmd

    root, _, tok = data
    (root / "kv.jsonl").write_text("".join(json.dumps({"text": f"doc {i}", "title": f"T{i}"}) + "\n" for i in range(5)))

    def call(mod, argv):
        p = argparse.ArgumentParser()
        mod.add_arguments(p)
        return mod.run(p.parse_args(argv))

    assert call(pre_cmd, ["--input", str(root / "kv.jsonl"), "--json-keys", "text", "title", "--tokenizer", tok,
                          "--output-prefix", str(root / "kv"), "--workers", "2", "--no-progress"]) == 0
    assert len(_docs(root / "kv_text")) == 5 and len(_docs(root / "kv_title")) == 5
    capsys.readouterr()
    assert call(data_cmd, ["inspect", str(root / "kv_title"), "--docs", "2"]) == 0
    out = capsys.readouterr().out
    assert "documents: 5" in out and "T0<|endoftext|>" in out and "T1" in out
    assert call(data_cmd, ["merge", "--inputs", str(root / "kv_text"), str(root / "kv_title"),
                           "--output-prefix", str(root / "kv_all")]) == 0
    assert _docs(root / "kv_all") == _docs(root / "kv_text") + _docs(root / "kv_title")


def test_ctrl_c_leaves_no_complete_looking_pair(data, tmp_path):
    """SIGINT to the whole process group (what Ctrl-C does) mid-run: temp files go, no .bin/.idx stays."""
    import signal
    import subprocess
    import sys

    from _pause import ended, pause_env, wait_paused

    root, jsonl, tok = data
    big = tmp_path / "big.jsonl"
    big.write_bytes(open(jsonl, "rb").read() * 150)  # long enough to be interrupted mid-way
    out = tmp_path / "out"
    out.mkdir()
    paused = tmp_path / "paused"  # the run stops after its 4th batch (2 shards done, a 3rd open) until the signal
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "preprocess_data.py")
    proc = subprocess.Popen([sys.executable, tool, "--input", str(big), "--tokenizer", tok, "--output-prefix",
                             str(out / "x"), "--workers", "2", "--shard-size-mb", "0.2", "--no-progress",
                             "--backend", "reference"],  # its pool of workers: Ctrl-C must end them too
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **pause_env("preprocess.batch@4", paused)},
                            # A suite started as a background job (`pytest ... &` from a script) inherits SIGINT
                            # ignored, as POSIX shells set it for asynchronous commands, and so would this child,
                            # which would then rightly run to the end. Ctrl-C at a terminal meets the default.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_paused(paused, ended(proc))
    assert any(".partial-" in f for f in os.listdir(out)) and len(os.listdir(out)) >= 4, os.listdir(out)
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert os.listdir(out) == []  # finished temp shards, the open one and its partial .bin: all removed


@pytest.mark.parametrize("moved", [1, 2, 4])  # the first shard's .bin alone; its .bin and .idx; two shards
def test_an_interrupt_mid_commit_leaves_no_half_shard(data, tmp_path, monkeypatch, moved):
    """scancel's SIGTERM (a SystemExit, commands/preprocess_submit.py) can land while the shards are being
    moved into place (which could leave a final .bin with no .idx or meta). The output must then hold no shard
    at all, so the group reads as not done, not as done with a damaged or missing shard."""
    import megafixed.data.preprocess as pre

    root, jsonl, tok = data
    real_replace, moves = os.replace, []

    def replace(src, dst):
        if ".partial-" in str(src) and ".partial-" not in str(dst):  # the commit's, not the writer's own
            if len(moves) == moved:
                raise SystemExit(128 + 15)
            moves.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(pre.os, "replace", replace)
    with pytest.raises(SystemExit):
        _run([jsonl], tmp_path / "sh", tok, shard_size_mb=0.05)
    assert len(moves) == moved, "the commit had begun moving shards into place"
    assert sorted(os.listdir(tmp_path)) == [], "a half-committed shard (or a temp file) was left behind"
