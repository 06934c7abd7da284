"""A record from a corpus from elsewhere is read in bounded memory: a line, paragraph or file over
``--max-record-bytes`` is a bad record ("too_long"), counted and named with its file and line,
whatever the compression; the records around it come out as if it were any other bad record."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import zlib

import pytest

from megafixed.data.readers import decode_batch, iter_batches

GOOD = ["first document", "second one", "the third", "fourth and last"]
LIMIT = 100


def _write(path, data: bytes) -> str:
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data, 1))
    elif path.suffix == ".zst":
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        path.write_bytes(data)
    return str(path)


def _read(path: str, **kw):
    texts, bad, examples, blank = [], 0, [], 0
    for batch in iter_batches([path], ["text"], max_record_bytes=LIMIT, **kw):
        dec = decode_batch(batch, ["text"])
        texts += dec.texts["text"]
        bad += dec.bad["too_long"]
        examples += dec.examples
        blank += dec.blank
        assert sum(dec.bad.values()) == dec.bad["too_long"], dec.bad
    return texts, bad, examples, blank


def _line(text: str) -> bytes:
    return json.dumps({"text": text}).encode() + b"\n"


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
@pytest.mark.parametrize("block", [7, 64, 1 << 20])  # lines cut across many blocks, a few, or none
def test_jsonl_lines_over_the_limit_are_bad_records_named_by_line(tmp_path, suffix, block):
    at_limit = json.dumps({"text": "y" * (LIMIT - 12)}).encode()  # exactly LIMIT bytes: still a record
    assert len(at_limit) == LIMIT
    data = (_line(GOOD[0]) + _line("x" * 5000) + _line(GOOD[1]) + at_limit + b"\n" + b"\n" + _line(GOOD[2])
            + _line("z" * (LIMIT - 11)) + _line(GOOD[3]) + json.dumps({"text": "w" * 300}).encode())  # no newline
    path = _write(tmp_path / f"c{suffix}", data)
    texts, bad, examples, blank = _read(path, batch_bytes=block, batch_records=3)
    assert texts == [GOOD[0], GOOD[1], "y" * (LIMIT - 12), GOOD[2], GOOD[3]]
    assert bad == 3 and blank == 1
    assert [e.split(": ")[0] for e in examples] == [f"{path}:2", f"{path}:7", f"{path}:9"], examples
    assert "over the limit of 100 (--max-record-bytes)" in examples[0] and "5,012 bytes" in examples[0]


def test_text_lines_over_the_limit(tmp_path):
    data = b"a short line\n" + b"q" * 250 + b"\n" + b"\n" + b"another line\n" + b"\n" + b"last"
    path = _write(tmp_path / "t.txt.gz", data)
    texts, bad, examples, _ = _read(path, text_split="line")
    assert texts == ["a short line", "another line", "last"] and bad == 1
    assert examples[0].startswith(f"{path}:2: a record of 250 bytes"), examples


def test_text_paragraphs_over_the_limit(tmp_path):
    two_lines = b"p" * 60 + b"\n" + b"p" * 60 + b"\n"  # each line within the limit, the paragraph not
    data = b"a short line\n\n" + two_lines + b"\n" + b"q" * 250 + b"\n\nanother line\n\nlast\n"
    path = _write(tmp_path / "t.txt.zst", data)
    texts, bad, examples, _ = _read(path, text_split="paragraph")
    assert texts == ["a short line", "another line", "last"] and bad == 2
    assert [e.split(": ")[0] for e in examples] == [f"{path}:2", f"{path}:3"], examples
    assert "a record of 122 bytes" in examples[0]


def test_text_split_file_reads_no_further_than_the_limit(tmp_path):
    small = _write(tmp_path / "small.txt", b"a whole file\nof two lines\n")
    big = _write(tmp_path / "big.txt.gz", b"word " * 1000)
    assert _read(small, text_split="file")[:2] == (["a whole file\nof two lines"], 0)  # as before: one document
    texts, bad, examples, _ = _read(big, text_split="file")
    assert texts == [] and bad == 1 and examples[0].startswith(f"{big}:1: a record of more than 100 bytes")


def test_strict_stops_at_a_record_over_the_limit_naming_it(tmp_path):
    from megafixed.data.errors import DataError

    path = _write(tmp_path / "c.jsonl", _line(GOOD[0]) + _line("x" * 500))
    with pytest.raises(DataError, match=rf"{path}:2: a record of 512 bytes, over the limit of 100 .*--strict"):
        for batch in iter_batches([path], ["text"], max_record_bytes=LIMIT):
            decode_batch(batch, ["text"], strict=True)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    from megafixed.data import BUNDLED_CORPUS
    from megafixed.data.tokenizers import train_tokenizer

    return train_tokenizer([BUNDLED_CORPUS], str(tmp_path_factory.mktemp("tok") / "tok.json"), 300)


def test_the_documents_around_a_long_record_are_written_as_without_it(tmp_path, tok):
    from megafixed.data.indexed import IndexedShard
    from megafixed.data.preprocess import PreprocessOptions, preprocess

    with_long = _write(tmp_path / "with.jsonl.gz", _line(GOOD[0]) + _line("x" * 5000) + _line(GOOD[1]))
    without = _write(tmp_path / "without.jsonl.gz", _line(GOOD[0]) + _line(GOOD[1]))
    reports = {}
    for name, path in (("with", with_long), ("without", without)):
        reports[name] = preprocess(PreprocessOptions(inputs=[path], output_prefix=str(tmp_path / name), tokenizer=tok,
                                                     max_record_bytes=1000, progress=False))
    assert reports["with"].bad["too_long"] == 1 and reports["without"].bad["too_long"] == 0
    assert reports["with"].bad_examples == [f"{with_long}:2: a record of 5,012 bytes, over the limit of 1,000 "
                                            f"(--max-record-bytes); skipped"]
    assert "skipped bad records: {'too_long': 1}" in reports["with"].summary()
    docs = {name: [IndexedShard(str(tmp_path / name))[i].tolist() for i in range(2)] for name in reports}
    assert docs["with"] == docs["without"] and reports["with"].documents == 2


# ----------------------------------------------------------------------------------- the CLI, in bounded memory
HUGE = 256 << 20

RUN_AND_MEASURE = """
import sys
from megafixed.cli import main
rc = main(sys.argv[2:])
peak = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")).split()[1]
open(sys.argv[1], "w").write(peak)
sys.exit(rc)
"""


def _huge_one_line_gz(path) -> None:
    """{"text": "aaaa...  (256 MiB, no newline anywhere) gzipped at level 1 as a stream: seconds, little memory."""
    z = zlib.compressobj(1, zlib.DEFLATED, 31)
    chunk = b"a" * (1 << 20)
    with open(path, "wb") as fh:
        fh.write(z.compress(b'{"text": "'))
        for _ in range(HUGE >> 20):
            fh.write(z.compress(chunk))
        fh.write(z.flush())


def _preprocess(tmp_path, corpus, tok, name) -> tuple[subprocess.CompletedProcess, int]:
    peak = tmp_path / f"{name}.peak"
    out = subprocess.run([sys.executable, "-c", RUN_AND_MEASURE, str(peak), "preprocess", "--input", str(corpus),
                          "--tokenizer", tok, "--output-prefix", str(tmp_path / name), "--no-progress",
                          "--backend", "reference"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out, int(peak.read_text()) << 10


def test_a_256_mib_one_line_gzipped_jsonl_is_one_line_and_bounded_memory(tmp_path, tok):
    small = tmp_path / "small.jsonl.gz"
    small.write_bytes(gzip.compress(_line("a" * 1000)))
    huge = tmp_path / "huge.jsonl.gz"
    _huge_one_line_gz(huge)
    base, base_peak = _preprocess(tmp_path, small, tok, "small")
    assert base.returncode == 0, base.stderr
    out, peak = _preprocess(tmp_path, huge, tok, "huge")
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, out.stderr  # the exit of a corpus with only bad records
    assert f"{huge}:1: a record of {HUGE + 10:,} bytes, over the limit of {64 << 20:,}" in err[0], err
    assert "too_long" in err[0] and "--max-record-bytes" in err[0]
    assert peak - base_peak < 128 << 20, (peak - base_peak) >> 20  # well below the line's 256 MiB
    assert not list(tmp_path.glob("huge*.bin"))
