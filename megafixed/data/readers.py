"""Stream documents out of raw corpora: JSONL (plain, .gz, .zst), parquet and plain text.

Readers split work in two: the parent process only cuts the input into ordered *batches* of raw
records (bytes lines, parquet column slices, text paragraphs); :func:`decode_batch` -- run in the
worker processes -- turns them into texts and counts bad records. So JSON parsing and UTF-8
decoding scale with the workers, and output order never depends on the worker count.

Nothing here holds a whole file in memory: JSONL is read line by line through the
decompressor, parquet one record batch at a time (``ParquetFile.iter_batches``).
"""
from __future__ import annotations

import glob
import gzip
import io
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

from .errors import DataError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text", ".md")
TEXT_SPLITS = ("paragraph", "line", "file")
BAD_KINDS = ("undecodable", "bad_json", "missing_key", "bad_type", "empty")


@dataclass
class Batch:
    """An ordered slice of one input file, not yet decoded."""
    path: str
    first_record: int  # 1-based line (JSONL), row (parquet) or paragraph/line number (text)
    kind: str  # "jsonl" (bytes lines), "parquet" (dict key -> list of values), "text" (bytes chunks)
    records: list = field(default_factory=list)
    nbytes: int = 0


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files and globs -> sorted unique files (each glob sorted, inputs kept in the order given)."""
    out: list[str] = []
    for pat in patterns:
        if glob.has_magic(pat):
            matches = sorted(glob.glob(pat, recursive=True))
        else:
            matches = [pat] if os.path.exists(pat) else []
        if not matches:
            raise DataError(f"input {pat!r} matches no file; check the path or quote the glob")
        for m in matches:
            if os.path.isdir(m):
                raise DataError(f"input {m} is a directory; pass files or a glob like '{m}/*.jsonl'")
            if m not in out:
                out.append(m)
    return out


def file_format(path: str) -> str:
    name = path.lower()
    for comp in (".gz", ".zst", ".zstd"):
        if name.endswith(comp):
            name = name[: -len(comp)]
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    raise DataError(f"cannot tell the format of {path}; use .jsonl/.json (optionally .gz/.zst), "
                    f".parquet or .txt")


def open_binary(path: str):
    """A buffered binary stream that decompresses .gz and .zst transparently."""
    lower = path.lower()
    if lower.endswith(".gz"):
        return gzip.open(path, "rb")
    if lower.endswith((".zst", ".zstd")):
        import zstandard

        raw = open(path, "rb")
        # read_across_frames: files made by concatenating zstd frames (pzstd, cat a.zst b.zst)
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True,
                                                                             closefd=True), 1 << 20)
    return open(path, "rb", buffering=1 << 20)


def iter_batches(paths: list[str], json_keys: list[str], batch_records: int = 256,
                 batch_bytes: int = 4 << 20, text_split: str = "paragraph") -> Iterator[Batch]:
    """Cut every input, in order, into batches of at most ``batch_records`` records."""
    if text_split not in TEXT_SPLITS:
        raise DataError(f"text split {text_split!r} unknown; use one of {TEXT_SPLITS}")
    for path in paths:
        fmt = file_format(path)
        if fmt == "parquet":
            yield from _parquet_batches(path, json_keys, batch_records)
        elif fmt == "jsonl":
            yield from _jsonl_batches(path, batch_records, batch_bytes)
        else:
            yield from _line_batches(path, "text", _text_records(path, text_split), batch_records, batch_bytes)


def _line_batches(path, kind, records, batch_records, batch_bytes) -> Iterator[Batch]:
    batch = Batch(path, 1, kind)
    n = 0
    for rec in records:
        n += 1
        batch.records.append(rec)
        batch.nbytes += len(rec)
        if len(batch.records) >= batch_records or batch.nbytes >= batch_bytes:
            yield batch
            batch = Batch(path, n + 1, kind)
    if batch.records:
        yield batch


def _jsonl_batches(path: str, batch_records: int, batch_bytes: int) -> Iterator[Batch]:
    """A JSONL file's lines (each keeps its newline, as iterating the file gives them) in batches of
    at most ``batch_records`` lines, cut from blocks read ``batch_bytes`` at a time: ``readlines`` of
    a block runs in C, where iterating the file line by line cost a third of the JSON parse."""
    first, pending = 1, []  # pending: the start of a line that runs past the block read so far
    try:
        with open_binary(path) as fh:
            while True:
                block = fh.read(max(1, batch_bytes))
                if not block:
                    break
                if b"\n" not in block:
                    pending.append(block)
                    continue
                data = b"".join(pending) + block if pending else block
                lines = io.BytesIO(data).readlines()
                pending = [] if lines[-1].endswith(b"\n") else [lines.pop()]
                if len(lines) <= batch_records:  # the whole block is one batch: its size needs no sum
                    yield Batch(path, first, "jsonl", lines, len(data) - (len(pending[0]) if pending else 0))
                else:
                    for i in range(0, len(lines), batch_records):
                        part = lines[i:i + batch_records]
                        yield Batch(path, first + i, "jsonl", part, sum(map(len, part)))
                first += len(lines)
    except _decompression_errors() as exc:
        raise _corrupt(path, exc) from exc
    if pending:  # a last line without its newline
        last = b"".join(pending)
        yield Batch(path, first, "jsonl", [last], len(last))


def _corrupt(path: str, exc: BaseException) -> DataError:
    """gzip/zstd errors name neither the file nor the fix (in a glob of 1000 files that matters)."""
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, EOFError):
        what = "is truncated (the compressed stream ends early)"
    else:
        what = f"is not a valid {os.path.splitext(path)[1] or 'compressed'} file ({msg})"
    return DataError(f"input {path} {what}; re-download or re-compress it, or leave it out of --input")


def _decompression_errors() -> tuple:
    import zlib

    errs: tuple = (gzip.BadGzipFile, EOFError, zlib.error)
    try:
        import zstandard

        errs += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errs


def _guarded(path: str, records: Iterator[bytes]) -> Iterator[bytes]:
    try:
        yield from records
    except _decompression_errors() as exc:
        raise _corrupt(path, exc) from exc
    except IsADirectoryError as exc:
        raise DataError(f"input {path} is a directory; pass files or a glob like '{path}/*.jsonl'") from exc


def _text_records(path: str, split: str) -> Iterator[bytes]:
    with open_binary(path) as fh:
        fh = _guarded(path, fh)
        if split == "file":
            yield b"".join(fh)
        elif split == "line":
            yield from fh
        else:  # paragraphs: runs of non-blank lines separated by blank lines
            para: list[bytes] = []
            for line in fh:
                if line.strip():
                    para.append(line)
                elif para:
                    yield b"".join(para)
                    para = []
            if para:
                yield b"".join(para)


def _parquet_batches(path: str, json_keys: list[str], batch_records: int) -> Iterator[Batch]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow.ArrowInvalid & co. say "Parquet magic bytes not found", no file
        raise DataError(f"input {path} is not a readable parquet file ({str(exc).splitlines()[0]}); re-export "
                        f"it, or rename it if it is another format") from exc
    names = pf.schema_arrow.names
    missing = [k for k in json_keys if k not in names]
    if missing:
        raise DataError(f"{path} has no column {missing}; its columns are {names}; pass --json-keys "
                        f"with one of them")
    row = 1
    for rb in pf.iter_batches(batch_size=batch_records, columns=list(json_keys)):
        cols = {k: rb.column(k).to_pylist() for k in json_keys}
        nbytes = sum(rb.column(k).nbytes for k in json_keys)
        yield Batch(path, row, "parquet", [cols], nbytes)
        row += rb.num_rows


# ----------------------------------------------------------------------------------- decoding
@dataclass
class Decoded:
    texts: dict  # key -> list[str] of good documents, in input order
    bad: Counter  # (kind) -> count
    examples: list  # a few "file:record: problem" strings
    blank: int = 0


def _bad(out: Decoded, kind: str, where: str, strict: bool, msg: str) -> None:
    text = f"{where}: {msg}"
    if strict:
        raise DataError(f"{text} (bad input under --strict; fix the record or drop --strict to skip "
                        f"and count bad records)")
    out.bad[kind] += 1
    if len(out.examples) < 5:
        out.examples.append(text)


def _accept(out: Decoded, key: str, value, where: str, strict: bool) -> None:
    if value is None:
        _bad(out, "missing_key", where, strict, f"key {key!r} missing or null")
    elif not isinstance(value, str):
        _bad(out, "bad_type", where, strict, f"key {key!r} holds {type(value).__name__}, not text")
    elif not value.strip():
        _bad(out, "empty", where, strict, f"key {key!r} is empty")
    else:
        out.texts[key].append(value)


def _fast_loads():
    """orjson's parser (several times faster than ``json``) where installed, else None.

    Only ever used to take the common case quickly: orjson accepts strictly less than ``json``
    (no NaN, big integers, lone surrogates, invalid UTF-8), and a record it parses into good texts
    gets exactly the texts ``json`` would give. Anything else goes through the ``json`` path below,
    so counts and messages for bad records are unchanged."""
    try:
        import orjson
    except ImportError:
        return None
    return orjson.loads


def decode_batch(batch: Batch, json_keys: list[str], strict: bool = False) -> Decoded:
    """Raw records -> texts per key, skipping (and counting) bad records, or raising under strict."""
    out = Decoded({k: [] for k in json_keys}, Counter(), [])
    if batch.kind == "parquet":
        cols = batch.records[0]
        for i in range(len(cols[json_keys[0]])):
            for k in json_keys:
                _accept(out, k, cols[k][i], f"{batch.path}:row {batch.first_record + i}", strict)
        return out
    fast = _fast_loads() if batch.kind == "jsonl" else None
    if fast is not None and len(json_keys) == 1:
        # The common case kept tight (this loop is the bulk of the CPU time beside gigatoken): a record
        # orjson parses into an object whose key holds non-blank text. ``v and not v.isspace()`` is
        # ``bool(v.strip())`` without copying the text. Anything else takes the exact path.
        key, dst = json_keys[0], out.texts[json_keys[0]]
        for i, raw in enumerate(batch.records):
            try:
                v = fast(raw).get(key)
            except (ValueError, AttributeError):  # not JSON to orjson, or not an object
                v = None
            if type(v) is str and v and not v.isspace():
                dst.append(v)
            else:
                _decode_record(out, batch, i, raw, json_keys, strict)
        return out
    texts = [out.texts[k] for k in json_keys]
    for i, raw in enumerate(batch.records):
        if fast is not None:
            try:
                obj = fast(raw)
            except ValueError:  # orjson.JSONDecodeError: let the exact path below say what is wrong
                obj = None
            if type(obj) is dict:
                vals = [obj.get(k) for k in json_keys]
                if all(type(v) is str and v.strip() for v in vals):  # every key good: the common case
                    for dst, v in zip(texts, vals):
                        dst.append(v)
                    continue
        _decode_record(out, batch, i, raw, json_keys, strict)
    return out


def _decode_record(out: Decoded, batch: Batch, i: int, raw: bytes, json_keys: list[str], strict: bool) -> None:
    """The exact path for one record (``json``, every check, the bad-record counts and messages)."""
    where = f"{batch.path}:{batch.first_record + i}"
    if not raw.strip():
        out.blank += 1  # a blank line holds no record (JSONL, or text split by lines); not an error
        return
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        _bad(out, "undecodable", where, strict, f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
        return
    if batch.kind == "text":
        _accept(out, json_keys[0], line[:-1] if line.endswith("\n") else line, where, strict)
        return
    try:
        obj = json.loads(line)
    except ValueError as exc:
        _bad(out, "bad_json", where, strict, f"not valid JSON ({exc})")
        return
    if not isinstance(obj, dict):
        _bad(out, "bad_json", where, strict, f"JSON value is a {type(obj).__name__}, not an object")
        return
    for k in json_keys:
        _accept(out, k, obj.get(k), where, strict)


def iter_texts(inputs: list[str], json_key: str = "text", text_split: str = "paragraph") -> Iterator[str]:
    """Good documents of every input, in order (bad records skipped). For tokenizer training."""
    for batch in iter_batches(expand_inputs(inputs), [json_key], text_split=text_split):
        yield from decode_batch(batch, [json_key]).texts[json_key]
