"""Tokenize raw corpora into Megatron ``.bin/.idx`` shards with worker processes.

Order and output are deterministic for any worker count: the parent cuts the inputs into ordered
batches (:mod:`readers`), workers decode + tokenize them, and the parent writes results strictly
in batch order (at most ``4 * workers`` batches in flight, so memory stays flat on any corpus).

Shards appear atomically: everything is written under temporary names and renamed into place
at the very end (``.bin`` first, ``.idx`` last), so an interrupted run leaves nothing that looks
complete, and stale shards from an earlier run with more shards are removed first.
"""
from __future__ import annotations

import glob
import itertools
import multiprocessing as mp
import os
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from ..atomic import atomic_write_text
from ..plural import count
from .errors import DataError, check_vocab_fits
from .indexed import ShardWriter, bin_path, dtype_for_vocab, idx_path, meta_path
from .readers import BAD_KINDS, Batch, decode_batch, expand_inputs, iter_batches
from .tokenizers import load_tokenizer, tokenizer_sha256


@dataclass
class PreprocessOptions:
    inputs: list
    output_prefix: str
    tokenizer: Any  # path, describe() dict or Tokenizer
    json_keys: list = field(default_factory=lambda: ["text"])
    workers: int = 1
    append_eod: bool = True
    shard_size_mb: Optional[float] = None  # None -> one shard per key
    strict: bool = False
    text_split: str = "paragraph"
    code_bits: Optional[int] = None  # refuse a vocab larger than 2**code_bits
    batch_records: int = 256
    progress: bool = True
    extra_meta: dict = field(default_factory=dict)  # stored in every shard's .meta.json


@dataclass
class PreprocessReport:
    outputs: dict  # json key -> list of shard prefixes
    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    bad: dict = field(default_factory=dict)
    bad_examples: list = field(default_factory=list)
    blank_lines: int = 0
    dtype: str = ""
    workers: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        secs = max(self.seconds, 1e-9)
        lines = [f"wrote {count(self.documents, 'document')}, {count(self.tokens, 'token')} ({self.dtype}) in "
                 f"{self.seconds:.1f}s ({self.tokens / secs:,.0f} tokens/s, {self.input_bytes / secs / 1e6:.1f} MB/s, "
                 f"{count(self.workers, 'worker')})"]
        for key, prefixes in self.outputs.items():
            more = f" ... {prefixes[-1]} ({len(prefixes)} shards)" if len(prefixes) > 1 else ""
            lines.append(f"  {key}: {prefixes[0]}{more}")
        skipped = {k: v for k, v in self.bad.items() if v}
        if skipped:
            lines.append(f"  skipped bad records: {skipped}")
            lines += [f"    e.g. {e}" for e in self.bad_examples]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------- workers
_STATE: dict = {}


def _init_worker(tok_desc: dict, json_keys: list, strict: bool, append_eod: bool, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker; workers are the parallelism
    _STATE.update(tok=load_tokenizer(tok_desc), keys=list(json_keys), strict=strict,
                  append_eod=append_eod, dtype=np.dtype(dtype))


def _encode(batch: Batch):
    """One batch -> per key (flat tokens, lengths), plus bad-record counts. Runs in a worker."""
    tok, keys, strict = _STATE["tok"], _STATE["keys"], _STATE["strict"]
    dec = decode_batch(batch, keys, strict)
    out = {}
    for key in keys:
        texts = dec.texts[key]
        ids = tok.encode_batch(texts) if texts else []
        if _STATE["append_eod"]:
            for doc in ids:
                doc.append(tok.eod_id)
        keep = [d for d in ids if d]
        if len(keep) != len(ids):  # text that tokenizes to nothing (and no EOD appended)
            n = len(ids) - len(keep)
            if strict:
                last = batch.first_record + len(batch.records) - 1
                raise DataError(f"{batch.path}: {n} document(s) in records {batch.first_record}..{last} tokenize "
                                f"to zero tokens (bad input under --strict; use --append-eod or drop --strict)")
            dec.bad["empty"] += n
        lengths = np.fromiter((len(d) for d in keep), dtype=np.int64, count=len(keep))
        total = int(lengths.sum())
        tokens = np.fromiter(itertools.chain.from_iterable(keep), dtype=np.int64, count=total)
        out[key] = (tokens.astype(_STATE["dtype"]), lengths)
    return out, dec.bad, dec.examples, dec.blank, batch.nbytes


# ----------------------------------------------------------------------------------- output
class _ShardedOutput:
    """One json key's output: rolls to a new shard at a document boundary past ``shard_bytes``."""

    def __init__(self, prefix: str, dtype: np.dtype, shard_bytes: Optional[int]):
        self.prefix, self.dtype, self.shard_bytes = prefix, dtype, shard_bytes
        self.tmp_base = f"{prefix}.partial-{os.getpid()}"
        self.done: list[str] = []  # temp prefixes of finished shards
        self.writer: Optional[ShardWriter] = None

    def _tmp_prefix(self, i: int) -> str:
        return f"{self.tmp_base}_{i:05d}" if self.shard_bytes else self.tmp_base

    def final_prefix(self, i: int) -> str:
        return f"{self.prefix}_{i:05d}" if self.shard_bytes else self.prefix

    def _open(self) -> ShardWriter:
        if self.writer is None:
            self.writer = ShardWriter(self._tmp_prefix(len(self.done)), self.dtype)
        return self.writer

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.finalize()
            self.done.append(self.writer.prefix)
            self.writer = None

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        item = self.dtype.itemsize
        while len(lengths):
            w = self._open()
            if not self.shard_bytes:
                w.add_documents(tokens, lengths)
                return
            ends = np.cumsum(lengths) * item
            k = int(np.searchsorted(ends, self.shard_bytes - w.bytes_written, side="right"))
            if k == 0 and w.num_docs:  # the next document would overflow this shard: roll
                self._close()
                continue
            k = max(k, 1)  # an oversize document gets a shard of its own
            n = int(lengths[:k].sum())
            w.add_documents(tokens[:n], lengths[:k])
            tokens, lengths = tokens[n:], lengths[k:]

    def commit(self, meta: dict) -> list[str]:
        if self.writer is None and not self.done:
            self._open()  # no documents at all: still write a valid, empty shard
        self._close()
        # remove every old shard of this prefix first, so a shorter re-run leaves no extra shards
        old = glob.glob(glob.escape(self.prefix) + "_[0-9][0-9][0-9][0-9][0-9].*") if self.shard_bytes else []
        for p in sorted(old, key=lambda p: not p.endswith(".idx")):  # .idx first: never a .idx without .bin
            if p.endswith((".idx", ".bin", ".meta.json")) and os.path.exists(p):
                os.remove(p)
        finals = []
        for i, tmp in enumerate(self.done):
            final = self.final_prefix(i)
            if os.path.exists(idx_path(final)):
                os.remove(idx_path(final))
            os.replace(bin_path(tmp), bin_path(final))
            _write_meta(final, {**meta, "shard": i, "num_shards": len(self.done)})
            os.replace(idx_path(tmp), idx_path(final))
            finals.append(final)
        return finals

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
        for tmp in self.done:
            for p in (bin_path(tmp), idx_path(tmp), meta_path(tmp)):
                if os.path.exists(p):
                    os.remove(p)


def _write_meta(prefix: str, meta: dict) -> None:
    import json

    atomic_write_text(meta_path(prefix), json.dumps(meta, indent=1))


# ----------------------------------------------------------------------------------- driver
def _progress(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, pipes), where it would only add lines
    return tqdm(unit="doc", unit_scale=True, dynamic_ncols=True, file=sys.stderr, desc="tokenizing",
                mininterval=0.5, disable=None)


def preprocess(opts: PreprocessOptions) -> PreprocessReport:
    """Tokenize ``opts.inputs`` into shards; returns counts, timings and bad-record statistics."""
    if not opts.json_keys:
        raise DataError("--json-keys needs at least one key")
    if opts.shard_size_mb is not None and opts.shard_size_mb <= 0:
        raise DataError(f"--shard-size-mb must be > 0, got {opts.shard_size_mb}")
    paths = expand_inputs(list(opts.inputs))
    tok = load_tokenizer(opts.tokenizer)
    if opts.code_bits is not None:
        check_vocab_fits(tok.vocab_size, code_bits=opts.code_bits, where=f"tokenizer {tok.path}")
    dtype = dtype_for_vocab(tok.vocab_size)
    workers = max(1, int(opts.workers))
    shard_bytes = int(opts.shard_size_mb * (1 << 20)) if opts.shard_size_mb else None
    keys = list(opts.json_keys)
    outputs = {k: _ShardedOutput(opts.output_prefix if len(keys) == 1 else f"{opts.output_prefix}_{k}",
                                 dtype, shard_bytes) for k in keys}
    report = PreprocessReport(outputs={}, dtype=str(dtype), workers=workers)
    bad: Counter = Counter()
    bar = _progress(opts.progress)
    t0 = time.perf_counter()
    init_args = (tok.describe(), keys, opts.strict, opts.append_eod, str(dtype))
    batches = iter_batches(paths, keys, opts.batch_records, text_split=opts.text_split)

    def consume(result) -> None:
        per_key, nbad, examples, blank, nbytes = result
        for k, (tokens, lengths) in per_key.items():
            outputs[k].add(tokens, lengths)
            if k == keys[0]:
                report.documents += len(lengths)
            report.tokens += tokens.size
        bad.update(nbad)
        report.bad_examples.extend(examples[: max(0, 5 - len(report.bad_examples))])
        report.blank_lines += blank
        report.input_bytes += nbytes
        if bar is not None:
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.update(len(next(iter(per_key.values()))[1]))
            bar.set_postfix_str(f"{report.tokens / dt:,.0f} tok/s, {report.input_bytes / dt / 1e6:.1f} MB/s")

    try:
        if workers == 1:
            _init_worker(*init_args)
            for batch in batches:
                consume(_encode(batch))
        else:
            # fork: workers inherit the imported modules, so start-up costs milliseconds, not seconds
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            with ctx.Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
                pending: deque = deque()
                for batch in batches:
                    pending.append(pool.apply_async(_encode, (batch,)))
                    if len(pending) >= 4 * workers:
                        consume(pending.popleft().get())
                while pending:
                    consume(pending.popleft().get())
        report.seconds = time.perf_counter() - t0
        report.bad = {k: int(bad.get(k, 0)) for k in BAD_KINDS}
        if report.documents == 0 and not any(report.bad.values()):
            # An empty shard would only fail later (no sample to train on), far from the cause.
            raise DataError(f"no document written: the inputs {paths} hold no text (empty files, or only blank "
                            f"lines); check --input")
        if report.documents == 0 and any(report.bad.values()):
            # Every record was skipped: almost always the wrong --json-keys or input format. An empty
            # shard would only fail later, far from the cause; the except below removes the temp files.
            skipped = {k: v for k, v in report.bad.items() if v}
            example = f" (e.g. {report.bad_examples[0]})" if report.bad_examples else ""
            raise DataError(f"no document written: every record was skipped as bad {skipped}{example}; "
                            f"check --json-keys {' '.join(keys)} against the records' fields, or the input format")
        meta = {"tokenizer": tok.describe(), "tokenizer_sha256": tokenizer_sha256(tok),
                "vocab_size": tok.vocab_size, "eod_id": tok.eod_id,
                "append_eod": opts.append_eod, "dtype": str(dtype), "inputs": [os.path.abspath(p) for p in paths],
                "documents": report.documents, "bad_records": report.bad, **opts.extra_meta}
        for k, out in outputs.items():
            report.outputs[k] = out.commit({**meta, "json_key": k})
    except BaseException:
        for out in outputs.values():
            out.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    return report
