"""Tokenize raw corpora into Megatron ``.bin/.idx`` shards, streaming, in bounded memory.

Order and output are deterministic for any worker count, chunk size and backend: the inputs are
cut into ordered batches (:mod:`readers`), each batch is decoded and tokenized, and results are
written strictly in batch order with a fixed number of batches in flight, so memory stays flat on
any corpus. Two backends (:mod:`fast_backend`): gigatoken, used when a check on a sample of the
input shows it gives the reference tokenizer's ids exactly (batches decoded in this process,
tokenized by gigatoken on --workers threads at once), and the reference engine (HF tokenizers / sentencepiece) in
worker processes. For tokenizers given by their files (not sentencepiece) the check runs in a
child process beside the fast pass (:mod:`reference_check`) and gates the commit: a mismatch
discards the fast output and redoes the run on the reference.

Shards appear atomically: everything is written under temporary names and renamed into place
at the very end (``.bin`` first, ``.idx`` last), so an interrupted run leaves nothing that looks
complete, and stale shards from an earlier run with more shards are removed first.
"""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from .. import pause as pauses
from ..atomic import atomic_write_text
from ..plural import count
from . import fast_backend
from .errors import DataError, check_vocab_fits
from .fast_backend import BACKENDS, GigatokenEncoder, PreparedFast, ReferenceEncoder, select_backend
from .indexed import ShardWriter, bin_path, dtype_for_vocab, idx_path, meta_path
from .readers import BAD_KINDS, DEFAULT_MAX_RECORD_BYTES, Batch, decode_batch, expand_inputs, iter_batches
from .reference_check import ReferenceCheck
from .tokenizers import Tokenizer, load_tokenizer, tokenizer_kind, tokenizer_sha256


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
    batch_records: Optional[int] = None  # records per batch; None -> 256 (reference), 16384 (gigatoken)
    chunk_mb: float = 4.0  # and at most this many MB of raw input per batch
    backend: str = "auto"  # auto | gigatoken | reference (see fast_backend.select_backend)
    verify_chars: int = 65536  # characters of input the start-up check compares the backends on
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES  # a longer record is a bad record ("too_long"), never held
    progress: bool = True
    extra_meta: dict = field(default_factory=dict)  # stored in every shard's .meta.json
    group: Optional[int] = None  # the input-file group of a ``--submit`` array task (MEGAFIXED_PAUSE's group=)


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
    backend: str = "reference"
    backend_note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        secs = max(self.seconds, 1e-9)
        lines = [f"wrote {count(self.documents, 'document')}, {count(self.tokens, 'token')} ({self.dtype}) in "
                 f"{self.seconds:.1f}s ({self.tokens / secs:,.0f} tokens/s, {self.input_bytes / secs / 1e6:.1f} MB/s, "
                 f"{count(self.workers, 'worker')})"]
        if self.backend_note:
            lines.append(f"  {self.backend_note}")
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
    # Ctrl-C reaches the whole process group, but stopping is the parent's (it terminates the pool). A worker
    # that died of the KeyboardInterrupt could leave the pool's task-queue lock taken (a signal landing between
    # the lock's acquire and its ``with`` block), and the parent's terminate() would wait on that lock forever.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tok = load_tokenizer(tok_desc)
    _STATE.update(encoder=ReferenceEncoder(tok), eod_id=tok.eod_id, keys=list(json_keys), strict=strict,
                  append_eod=append_eod, dtype=np.dtype(dtype))


def _with_eod(flat: np.ndarray, lengths: np.ndarray, eod_id: int, dtype: np.dtype):
    """Every document followed by ``eod_id``, as one flat array (no per-document Python work)."""
    out = np.empty(flat.size + len(lengths), dtype)
    ends = np.cumsum(lengths + 1) - 1
    keep = np.ones(out.size, bool)
    keep[ends] = False
    out[ends] = eod_id
    out[keep] = flat
    return out, lengths + 1


def _tokenize(batch: Batch, dec, state: dict):
    """Decoded batch -> per key (flat tokens, lengths), plus bad-record counts."""
    keys, strict, dtype = state["keys"], state["strict"], state["dtype"]
    out = {}
    for key in keys:
        flat, lengths = state["encoder"].encode_flat(dec.texts[key])
        if state["append_eod"]:
            tokens, lengths = _with_eod(flat, lengths, state["eod_id"], dtype)
        else:
            tokens = flat.astype(dtype)
            empty = int(np.count_nonzero(lengths == 0))
            if empty:  # text that tokenizes to nothing (and no EOD appended)
                if strict:
                    last = batch.first_record + len(batch.records) - 1
                    raise DataError(f"{batch.path}: {empty} document(s) in records {batch.first_record}..{last} "
                                    f"tokenize to zero tokens (bad input under --strict; use --append-eod or drop "
                                    f"--strict)")
                dec.bad["empty"] += empty
                lengths = lengths[lengths > 0]
        out[key] = (tokens, lengths)
    return out, dec.bad, dec.examples, dec.blank, batch.nbytes


def _encode(batch: Batch):
    """One batch -> what :func:`_tokenize` returns. Runs in a reference-backend worker."""
    return _tokenize(batch, decode_batch(batch, _STATE["keys"], _STATE["strict"]), _STATE)


def _startup_sample(paths: list, keys: list, text_split: str, max_chars: int, max_files: int = 4,
                    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> list:
    """(where, text) documents from the start of up to ``max_files`` inputs spread over the list."""
    picks = sorted({round(i * (len(paths) - 1) / max(1, max_files - 1)) for i in range(min(max_files, len(paths)))})
    budget = max(1, max_chars // len(picks))
    sample = []
    for p in picks:
        seen = 0
        for batch in iter_batches([paths[p]], keys, 1, batch_bytes=1 << 16, text_split=text_split,
                                  max_record_bytes=max_record_bytes):
            dec = decode_batch(batch, keys)
            for k in keys:
                for text in dec.texts[k]:
                    sample.append((f"{batch.path}:{batch.first_record}", text))
                    seen += len(text)
            if seen >= budget:
                break
    return sample


# ----------------------------------------------------------------------------------- output
class _ShardedOutput:
    """One json key's output: rolls to a new shard at a document boundary past ``shard_bytes``."""

    def __init__(self, prefix: str, dtype: np.dtype, shard_bytes: Optional[int]):
        self.prefix, self.dtype, self.shard_bytes = prefix, dtype, shard_bytes
        self.tmp_base = f"{prefix}.partial-{os.getpid()}"
        self.done: list[str] = []  # temp prefixes of finished shards
        self.committed: list[str] = []  # final prefixes this commit has begun to move into place
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
            self.committed.append(final)  # before the first move: abort() must see a half-moved shard
            os.replace(bin_path(tmp), bin_path(final))
            _write_meta(final, {**meta, "shard": i, "num_shards": len(self.done)})
            os.replace(idx_path(tmp), idx_path(final))
            finals.append(final)
        return finals

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
        # a commit interrupted (scancel's SIGTERM can land mid-way) leaves no half shard: a .bin
        # moved into place without its .idx, or a shard set missing its tail. .idx first: never an .idx without its .bin
        for prefix in [*self.committed, *self.done]:
            for p in (idx_path(prefix), meta_path(prefix), bin_path(prefix)):
                if os.path.exists(p):
                    os.remove(p)
        # and a writer interrupted while opening (its file made, not yet ours to abort): every temp name
        for p in glob.glob(glob.escape(self.tmp_base) + "*"):
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


class _NotExact(Exception):
    """The reference check, arriving after the fast pass, says gigatoken was not exact."""


def preprocess(opts: PreprocessOptions) -> PreprocessReport:
    """Tokenize ``opts.inputs`` into shards; returns counts, timings and bad-record statistics."""
    if not opts.json_keys:
        raise DataError("--json-keys needs at least one key")
    if opts.shard_size_mb is not None and opts.shard_size_mb <= 0:
        raise DataError(f"--shard-size-mb must be > 0, got {opts.shard_size_mb}")
    if opts.chunk_mb <= 0:
        raise DataError(f"--chunk-mb must be > 0, got {opts.chunk_mb}")
    paths = expand_inputs(list(opts.inputs))
    keys = list(opts.json_keys)
    if opts.backend not in BACKENDS:
        raise DataError(f"--backend {opts.backend!r} unknown; use one of {BACKENDS}")
    sample, prepared = [], None
    if opts.backend != "reference":
        sample = _startup_sample(paths, keys, opts.text_split, opts.verify_chars,
                                 max_record_bytes=opts.max_record_bytes)
        if _checked_beside(opts.tokenizer):
            report, note = _fast_with_check_beside(opts, paths, keys, sample)
            if report is not None:
                return report
            if opts.backend == "gigatoken":
                where = os.path.abspath(opts.tokenizer)
                raise DataError(f"--backend gigatoken does not reproduce tokenizer {where}: {note}; use --backend auto")
            note = f"backend: reference tokenizer, not gigatoken: {note}"
            if opts.progress:
                print(note, flush=True)  # the fallback, said at once (stdout: stderr is for the one error line)
            tok = load_tokenizer(opts.tokenizer)
            return _run(opts, paths, keys, tok, ReferenceEncoder(tok), note)
        if not isinstance(opts.tokenizer, (dict, Tokenizer)):  # from the files: loads beside the reference
            prepared = PreparedFast(opts.tokenizer, sample)
    tok = load_tokenizer(opts.tokenizer)
    encoder, note = select_backend(tok, sample, opts.backend, fast_backend.tokenize_threads(opts.workers), prepared)
    if opts.progress and encoder.name == "reference" and opts.backend != "reference":
        print(note, flush=True)  # the fallback, said at once (stdout: stderr is for the one error line)
    return _run(opts, paths, keys, tok, encoder, note)


def _checked_beside(spec) -> bool:
    """Whether the start-up check can run beside the fast pass: a tokenizer given by its files, and
    not a sentencepiece model (whose control-piece texts gigatoken must hand back to the reference,
    which needs the reference loaded first: that kind keeps the check-then-run order)."""
    if isinstance(spec, (dict, Tokenizer)):
        return False
    try:
        import gigatoken  # noqa: F401 (imported here anyway; without it the ordinary path says so)
    except ImportError:
        return False
    try:
        return tokenizer_kind(spec) != "sentencepiece"
    except DataError:
        return False  # the ordinary path says what is wrong with it


def _fast_with_check_beside(opts: PreprocessOptions, paths: list, keys: list, sample: list):
    """gigatoken writes temporary shards while a child process checks it against the reference
    (:mod:`reference_check`); they are committed only if the check passes. -> (report, None), or
    (None, why gigatoken is not exact) with nothing written."""
    check = ReferenceCheck(opts.tokenizer, sample)  # forks: before gigatoken starts any thread
    try:
        try:
            gt = fast_backend.load_gigatoken(opts.tokenizer)
        except DataError as exc:
            return None, str(exc)
        vocab_size, eod_id = fast_backend.gigatoken_facts(gt)
        if eod_id is None:  # the reference's load will name what is missing
            return None, "gigatoken's port has none of the end-of-document tokens"
        threads = fast_backend.tokenize_threads(opts.workers)
        encoder = GigatokenEncoder(gt, threads)

        def verified():
            facts = check.result()  # a DataError here: the reference itself does not load
            why = fast_backend.verify_against(facts, gt, vocab_size, eod_id, sample, threads)
            if why is not None:
                raise _NotExact(why)
            return facts

        note = f"backend: gigatoken (ids equal the reference on {len(sample)} sampled documents + probes)"
        try:
            return _run(opts, paths, keys, _Provisional(vocab_size, eod_id, opts.tokenizer), encoder, note,
                        verified), None
        except _NotExact as exc:
            return None, str(exc)
        except DataError:
            # the input's own errors (bad records under --strict, nothing to write) are the same on
            # either backend; but a reference that does not load must say so first
            check.result()
            raise
    finally:
        check.close()


@dataclass
class _Provisional:
    """The tokenizer's facts as gigatoken gives them, until the reference confirms them."""
    vocab_size: int
    eod_id: int
    path: Any


def _run(opts: PreprocessOptions, paths: list, keys: list, tok, encoder, note: str,
         verified=None) -> PreprocessReport:
    """Tokenize every batch with ``encoder`` into temporary shards and commit them. ``verified``:
    called before the commit; returns the tokenizer whose facts go into the metadata (default
    ``tok``), or raises, which removes every temporary file."""
    if opts.code_bits is not None:
        check_vocab_fits(tok.vocab_size, code_bits=opts.code_bits, where=f"tokenizer {tok.path}")
    dtype = dtype_for_vocab(tok.vocab_size)
    workers = max(1, int(opts.workers))
    shard_bytes = int(opts.shard_size_mb * (1 << 20)) if opts.shard_size_mb else None
    outputs = {k: _ShardedOutput(opts.output_prefix if len(keys) == 1 else f"{opts.output_prefix}_{k}",
                                 dtype, shard_bytes) for k in keys}
    report = PreprocessReport(outputs={}, dtype=str(dtype), workers=workers, backend=encoder.name, backend_note=note)
    bad: Counter = Counter()
    bar = _progress(opts.progress)
    t0 = time.perf_counter()
    batch_records = opts.batch_records or (16384 if encoder.name != "reference" else 256)
    batches = iter_batches(paths, keys, batch_records, batch_bytes=int(opts.chunk_mb * (1 << 20)),
                           text_split=opts.text_split, max_record_bytes=opts.max_record_bytes)
    pause, written = pauses.armed("preprocess.batch", group=opts.group), [0]  # MEGAFIXED_PAUSE: tests, drills

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
        written[0] += 1
        if pause is not None:  # this batch is in the temporary shards: stop here until a signal or a release
            pause.reached(written[0])

    try:
        _tokenize_all(batches, consume, encoder, tok, keys, opts, dtype, workers)
        report.seconds = time.perf_counter() - t0
        report.bad = {k: int(bad.get(k, 0)) for k in BAD_KINDS}
        _check_written(report, paths, keys)
        if verified is not None:
            tok = verified()
        _commit(outputs, report, tok, opts, dtype, paths)
    except BaseException:
        for out in outputs.values():
            out.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    return report


def _tokenize_all(batches, consume, encoder, tok, keys: list, opts: PreprocessOptions, dtype, workers: int) -> None:
    """Every batch tokenized, in input order, each result handed to ``consume``: gigatoken on
    threads, else the reference tokenizer in this process (one worker) or a pool of ``workers``."""
    fast = encoder.name != "reference"
    init_args = None if fast else (tok.describe(), keys, opts.strict, opts.append_eod, str(dtype))
    if fast:
        # Decode the next batch here while gigatoken (GIL released) tokenizes the earlier ones,
        # one batch per tokenizing thread; threads + 1 batches in flight bound the memory.
        state = {"encoder": encoder, "eod_id": tok.eod_id, "keys": keys, "strict": opts.strict,
                 "append_eod": opts.append_eod, "dtype": dtype}
        with ThreadPoolExecutor(encoder.threads, thread_name_prefix="tokenize") as ex:
            pending: deque = deque()
            for batch in batches:
                pending.append(ex.submit(_tokenize, batch, decode_batch(batch, keys, opts.strict), state))
                if len(pending) > encoder.threads:
                    consume(pending.popleft().result())
            while pending:
                consume(pending.popleft().result())
    elif workers == 1:
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


def _check_written(report: PreprocessReport, paths: list, keys: list) -> None:
    """One clear error when nothing was written (the caller removes the temporary files)."""
    if report.documents == 0 and not any(report.bad.values()):
        # An empty shard would only fail later (no sample to train on), far from the cause.
        raise DataError(f"no document written: the inputs {paths} hold no text (empty files, or only blank "
                        f"lines); check --input")
    if report.documents == 0 and any(report.bad.values()):
        # Every record was skipped: almost always the wrong --json-keys or input format. An empty
        # shard would only fail later, far from the cause; _run's except removes the temp files.
        skipped = {k: v for k, v in report.bad.items() if v}
        example = f" (e.g. {report.bad_examples[0]})" if report.bad_examples else ""
        fix = (f"check --json-keys {' '.join(keys)} against the records' fields, or the input format"
               if set(skipped) != {"too_long"} else "raise --max-record-bytes if such records are real documents")
        raise DataError(f"no document written: every record was skipped as bad {skipped}{example}; {fix}")


def _commit(outputs: dict, report: PreprocessReport, tok, opts: PreprocessOptions, dtype, paths: list) -> None:
    """Commit every key's shards with the metadata (the tokenizer's confirmed facts)."""
    meta = {"tokenizer": tok.describe(), "tokenizer_sha256": tokenizer_sha256(tok),
            "vocab_size": tok.vocab_size, "eod_id": tok.eod_id,
            "append_eod": opts.append_eod, "dtype": str(dtype), "inputs": [os.path.abspath(p) for p in paths],
            "documents": report.documents, "bad_records": report.bad, **opts.extra_meta}
    for k, out in outputs.items():
        report.outputs[k] = out.commit({**meta, "json_key": k})
