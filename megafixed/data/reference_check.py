"""The start-up exactness check, run beside the fast encoding instead of before it.

gigatoken is used only where it gives the reference tokenizer's ids (:mod:`fast_backend`). The
check needs the reference engine loaded (HF ``tokenizers`` / sentencepiece: about as long as
gigatoken takes to tokenize 30 MB) and both engines hold the GIL while they load, so a thread
would not overlap them. :class:`ReferenceCheck` therefore forks a child that loads the reference,
encodes the input sample and the probe texts, and sends back the ids and the tokenizer's facts
(vocabulary size, EOD id, ``describe()``), while the parent already tokenizes with gigatoken into
temporary shards. The parent compares before anything is renamed into place; on a mismatch the
fast output is discarded and the run redone with the reference. The check still decides; the
run does not wait for it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .errors import DataError


@dataclass
class ReferenceFacts:
    """What the reference tokenizer says: enough to write the shards' metadata and to compare."""
    path: str
    kind: str
    vocab_size: int
    eod_id: int
    description: dict
    probes: list  # (where, text): the built-in probes plus the special-token ones of this tokenizer
    flat: np.ndarray  # reference ids of sample + probes, concatenated
    lengths: np.ndarray

    def describe(self) -> dict:  # duck-types Tokenizer for the shard metadata (tokenizer_sha256 reads .path)
        return dict(self.description)


def reference_facts(spec, sample: list) -> ReferenceFacts:
    """Load the reference tokenizer ``spec`` and encode ``sample`` ((where, text) pairs) + the probes."""
    from .fast_backend import PROBES, ReferenceEncoder, special_probes
    from .tokenizers import load_tokenizer

    tok = load_tokenizer(spec)
    probes = [(f"probe {i + 1} (built-in check text)", t) for i, t in enumerate(PROBES)]
    probes += [(f"probe {len(PROBES) + i + 1} (special-token text)", t) for i, t in enumerate(special_probes(tok))]
    flat, lengths = ReferenceEncoder(tok).encode_flat([t for _, t in list(sample) + probes])
    return ReferenceFacts(tok.path, tok.kind, int(tok.vocab_size), int(tok.eod_id), tok.describe(), probes,
                          flat.astype(np.int64), lengths.astype(np.int64))


def _child(conn, spec, sample) -> None:
    # one thread: the parent's gigatoken threads are the ones that should have the cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        conn.send(("ok", reference_facts(spec, sample)))
    except DataError as exc:
        conn.send(("error", str(exc)))
    except BaseException as exc:  # a failure of the reference engine itself: said, never a hang
        conn.send(("error", f"the reference tokenizer failed on the sample ({type(exc).__name__}: {exc})"))
    finally:
        conn.close()


class ReferenceCheck:
    """Start :func:`reference_facts` now (a forked child; a thread where fork does not exist);
    :meth:`result` waits for it. Fork before gigatoken starts its thread pool (which a fork would
    break, in the child): the child never touches gigatoken anyway."""

    def __init__(self, spec, sample: list):
        self._proc = self._thread = None
        self._got: Optional[tuple] = None
        if "fork" in mp.get_all_start_methods():
            ctx = mp.get_context("fork")
            self._conn, child_conn = ctx.Pipe(duplex=False)
            self._proc = ctx.Process(target=_child, args=(child_conn, spec, sample), daemon=True,
                                     name="megafixed-reference-check")
            self._proc.start()
            child_conn.close()
        else:
            self._thread = threading.Thread(target=self._in_thread, args=(spec, sample), daemon=True)
            self._thread.start()

    def _in_thread(self, spec, sample) -> None:
        try:
            self._got = ("ok", reference_facts(spec, sample))
        except DataError as exc:
            self._got = ("error", str(exc))

    def result(self) -> ReferenceFacts:
        """The reference's facts, or :class:`DataError` saying why there are none."""
        if self._got is None:
            if self._thread is not None:
                self._thread.join()
            else:
                try:
                    self._got = self._conn.recv()
                except EOFError:  # killed (out of memory, a signal) before it could answer
                    self._proc.join(10)  # its pipe closes before it is reaped: wait for the exit code
                    self._got = ("error", f"the reference check process died (exit code {self._proc.exitcode})")
                self.close()
        if self._got is None:
            self._got = ("error", "the reference check failed")
        status, value = self._got
        if status != "ok":
            raise DataError(value)
        return value

    def close(self) -> None:
        """Stop the child if it still runs (an interrupted or failed run); idempotent."""
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.terminate()
            self._proc.join()
            self._conn.close()
            self._proc = None
