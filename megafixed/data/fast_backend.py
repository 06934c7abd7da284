"""The fast tokenizing backend: gigatoken (Rust BPE / SentencePiece-BPE), used only where it is exact.

gigatoken reproduces byte-level BPE (GPT-2 files, our trained BPE ``tokenizer.json``) and
SentencePiece-style BPE with byte fallback (sentencepiece ``.model``, Llama-style ``tokenizer.json``)
about 10x faster than HF ``tokenizers``; it refuses unigram models. Being fast is worth nothing if
one id differs, so :func:`select_backend` does not assume: it encodes a sample of the actual input
(plus :data:`PROBES`: non-ASCII, code, whitespace runs, the tokenizer's special-token strings)
with both gigatoken and the reference engine, and uses gigatoken only when every id agrees.
Otherwise preprocessing keeps the reference engine and says why in one line, naming the first
differing document.

Both encoders return one flat token array plus per-document lengths, which is what the shard
writer takes, so no per-token Python object is ever built on the fast path.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np

from .errors import DataError

BACKENDS = ("auto", "gigatoken", "reference")

# Texts every start-up check adds to the input sample: the classes where tokenizer ports differ
# (normalisation of non-ASCII, whitespace runs and tabs in code, digits, CRLF, leading spaces).
PROBES = (
    "Ünïcödé naïve café — “quotes” ‘single’ … Straße, Ελληνικά, русский текст, עברית, العربية.",
    "日本語のテキストと中文文本，한국어 텍스트。絵文字 🚀🔥👍🏽 and ZWJ 👩‍👩‍👧 plus e\u0301 combining.",
    "def f(x):\n\tif x  >  1:\n        return {'a': [1, 2, 3]}  # comment\r\n    return None\n\n\n",
    "   leading spaces, trailing spaces   \n\n  \t mixed \u00a0nbsp\u2009thin 1234567890 3.14159 0x1F",
    "int main() { printf(\"%d\\n\", a[i] += 2); }  // C++ <vector<int>> && || != ==",
)


class ReferenceEncoder:
    """Today's path: the tokenizer's own engine (HF ``tokenizers`` / sentencepiece)."""

    name = "reference"

    def __init__(self, tok):
        self.tok = tok

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = self.tok.encode_batch(list(texts)) if texts else []
        lengths = np.fromiter((len(d) for d in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter((i for d in ids for i in d), dtype=np.int64, count=int(lengths.sum()))
        return flat, lengths


def tokenize_threads(workers: int) -> int:
    """Tokenizing threads for ``--workers N``: N - 1, at least 1, each encoding whole batches on its
    own thread (gigatoken releases the GIL). The calling thread is the other worker: it reads and
    decodes the next batch's JSON, about as long as tokenizing it takes. Not gigatoken's rayon
    pool: on 2 cores its idle threads spin while the decoder catches up, 0.2-0.3 CPU-s more per
    35 MB (A/B under load: wall median 8.06 -> 6.57 s), and a pool would not survive the fork of a
    reference fallback's workers. Two tokenizing threads for 2 workers measured no faster on a
    quiet machine (1.18 vs 1.16 s) and held 16 MB more."""
    return max(1, int(workers) - 1)


class GigatokenEncoder:
    """gigatoken's batch encode as flat ids + lengths (:mod:`gigatoken_arrays`: no awkward import).

    ``reroute``: strings on which the port is known to differ from the reference (sentencepiece
    encodes the text "</s>" as ordinary pieces, gigatoken as the control token); the rare document
    holding one is tokenized by ``reference`` instead, so the output stays exact."""

    name = "gigatoken"

    def __init__(self, gt, threads: int, reference=None, reroute: Sequence[str] = ()):
        self.gt = gt
        # how many batches preprocessing tokenizes at once, each on its own thread; one batch is
        # always encoded on the thread that calls (gigatoken's rayon pool is never used, see
        # tokenize_threads), so no pool exists to be broken by a fork either
        self.threads = max(1, int(threads))
        self.reference, self.reroute = reference, tuple(reroute)

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        if not texts:
            return np.zeros(0, np.uint32), np.zeros(0, np.int64)
        from .gigatoken_arrays import encode_flat

        texts = list(texts)
        flat, lengths = encode_flat(self.gt, texts, False)
        hits = [i for i, t in enumerate(texts) if any(s in t for s in self.reroute)] if self.reroute else []
        if not hits:
            return flat, lengths
        docs = np.split(flat.astype(np.int64), np.cumsum(lengths)[:-1])
        ref_flat, ref_len = self.reference.encode_flat([texts[i] for i in hits])
        for i, piece in zip(hits, np.split(ref_flat, np.cumsum(ref_len)[:-1])):
            docs[i], lengths[i] = piece, len(piece)
        return np.concatenate(docs), lengths


def _gpt2_tokenizer_json(vocab_file: str, merges_file: str) -> bytes:
    """GPT-2's vocab + merges as the tokenizer.json that :class:`~.tokenizers.GPT2Tokenizer` builds
    (byte-level, ``<|endoftext|>`` special), so gigatoken loads without waiting for HF to. orjson
    and merges as ``"a b"`` strings (tokenizer.json's older form, which both engines read): this runs
    on every start-up, and ``json`` with per-merge lists cost a tenth of a second of it."""
    from .tokenizers import EOD_TOKEN

    try:
        import orjson

        loads, dumps = orjson.loads, orjson.dumps
    except ImportError:
        import json

        loads, dumps = json.loads, lambda obj: json.dumps(obj).encode()
    with open(vocab_file, "rb") as fh:
        vocab = loads(fh.read())
    with open(merges_file, encoding="utf-8") as fh:
        lines = [line.rstrip("\r") for line in fh.read().split("\n")]
    merges = [line for line in lines if line.strip() and not line.startswith("#version")]
    if any(line.count(" ") != 1 for line in merges):  # not a pair per line: keep the split form, as before
        merges = [line.split(" ") for line in merges]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return dumps({
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": vocab[EOD_TOKEN], "content": EOD_TOKEN, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}] if EOD_TOKEN in vocab else [],
        "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", **byte_level}, "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges}})


def load_gigatoken(spec):
    """gigatoken's port of a tokenizer (a loaded :class:`~.tokenizers.Tokenizer`, or the path it is
    loaded from), or raise :class:`DataError` saying why there is none. From a path it reads the
    files itself, so it can load while HF tokenizers does."""
    try:
        import gigatoken
    except ImportError as exc:
        raise DataError("gigatoken is not installed (pip install 'gigatoken>=0.10,<0.11')") from exc
    from .tokenizers import Tokenizer, _gpt2_files

    try:
        if isinstance(spec, Tokenizer):
            if spec.kind == "sentencepiece":
                return gigatoken.Tokenizer.from_sentencepiece(spec.path)
            return gigatoken.Tokenizer(spec._tok)  # HF / GPT-2: the very tokenizers object we would run
        path = os.fspath(spec)
        if os.path.isdir(path):
            files = _gpt2_files(path)
            if files:
                return gigatoken.Tokenizer.from_json(_gpt2_tokenizer_json(*files))
            for name in ("tokenizer.json", "tokenizer.model"):
                if os.path.isfile(os.path.join(path, name)):
                    return load_gigatoken(os.path.join(path, name))
        if path.endswith(".model"):
            return gigatoken.Tokenizer.from_sentencepiece(path)
        with open(path, "rb") as fh:
            return gigatoken.Tokenizer.from_json(fh.read())
    except Exception as exc:  # gigatoken names the unsupported model type in its first line
        raise DataError(f"gigatoken cannot load it ({str(exc).splitlines()[0]})") from exc


class PreparedFast:
    """gigatoken loaded from the tokenizer's files and its sample ids computed on a thread (gigatoken
    releases the GIL) while the caller loads the reference tokenizer: the start-up check then costs
    little more than the reference's own load. ``error``: why gigatoken could not load."""

    def __init__(self, spec, sample: list[tuple[str, str]]):
        import threading

        self.gt, self.error, self.ids = None, None, None
        try:
            self.gt = load_gigatoken(spec)
        except DataError as exc:
            self.error = exc
            return
        texts = [t for _, t in sample]
        self._thread = threading.Thread(target=self._encode, args=(texts,), daemon=True)
        self._thread.start()

    def _encode(self, texts) -> None:
        try:
            self.ids = GigatokenEncoder(self.gt, 1).encode_flat(texts)
        except Exception as exc:  # reported by the check, never lost in the thread
            self.error = DataError(f"gigatoken failed on the sample ({exc})")

    def result(self):
        if self.gt is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        return self.gt, self.ids


def gigatoken_facts(gt) -> tuple[int, Optional[int]]:
    """(vocab size, EOD id) as gigatoken's port sees them, chosen by the reference's rule (the
    first of :data:`~.tokenizers.EOD_CANDIDATES` that is a token), to write with before the
    reference has loaded; the check compares both with the reference's own, so a wrong guess here
    costs a fallback, never a wrong shard. A candidate is a token when it encodes to one id: cheap,
    where gigatoken's ``vocab`` builds a 50k-entry dict and its special-token list parses the whole
    tokenizer.json again."""
    from .tokenizers import EOD_CANDIDATES

    for piece in EOD_CANDIDATES:
        ids = gt.encode(piece)
        if len(ids) == 1:
            return int(gt.vocab_size), int(ids[0])
    return int(gt.vocab_size), None


def verify_against(facts, gt, vocab_size: int, eod_id: Optional[int], sample: list[tuple[str, str]],
                   threads: int = 1) -> Optional[str]:
    """Why gigatoken (loaded as ``gt``, written with ``vocab_size``/``eod_id``) is not exactly the
    reference whose :class:`~.reference_check.ReferenceFacts` are ``facts``; None when it is."""
    docs = list(sample) + list(facts.probes)
    why = first_mismatch(None, GigatokenEncoder(gt, threads), docs, ref_ids=(facts.flat, facts.lengths))
    if why is None and (vocab_size, eod_id) != (facts.vocab_size, facts.eod_id):
        why = (f"vocabulary size / EOD id {facts.vocab_size}/{facts.eod_id} (reference) vs "
               f"{vocab_size}/{eod_id} (gigatoken)")
    return why


def special_strings(tok) -> list[str]:
    """The tokenizer's special-token strings (HF added tokens; sentencepiece control/unknown pieces)."""
    inner = getattr(tok, "_tok", None)
    if inner is not None:
        return [t.content for t in inner.get_added_tokens_decoder().values()]
    if tok.kind == "sentencepiece":
        sp = tok._sp
        return [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]
    return []


def special_probes(tok) -> list[str]:
    """Texts holding the special-token strings (an EOD inside a document, say)."""
    return [f"before{s}after {s} end" for s in special_strings(tok)[:16]]


def first_mismatch(reference, fast, sample: list[tuple[str, str]], fast_ids=None, ref_ids=None) -> Optional[str]:
    """Encode ``sample`` ((where, text) pairs) with both; describe the first document that differs.
    ``fast_ids`` / ``ref_ids``: gigatoken's / the reference's (flat, lengths), when already computed."""
    texts = [t for _, t in sample]
    ref_flat, ref_len = ref_ids if ref_ids is not None else reference.encode_flat(texts)
    got_flat, got_len = fast_ids if fast_ids is not None else fast.encode_flat(texts)
    if np.array_equal(ref_len, got_len) and np.array_equal(ref_flat.astype(np.int64), got_flat.astype(np.int64)):
        return None
    ref_off = np.concatenate([[0], np.cumsum(ref_len)])
    got_off = np.concatenate([[0], np.cumsum(got_len)])
    for i, (where, _) in enumerate(sample):
        a = ref_flat[ref_off[i]:ref_off[i + 1]].astype(np.int64)
        b = got_flat[got_off[i]:got_off[i + 1]].astype(np.int64)
        if not np.array_equal(a, b):
            n = min(len(a), len(b))
            k = int(np.argmax(a[:n] != b[:n])) if n and np.any(a[:n] != b[:n]) else n
            ra = int(a[k]) if k < len(a) else "end"
            gb = int(b[k]) if k < len(b) else "end"
            return f"first differing document {where}: token {k} is {ra} (reference) vs {gb} (gigatoken)"
    return "the token streams differ"  # unreachable unless lengths disagree without a differing doc


def select_backend(tok, sample: list[tuple[str, str]], backend: str = "auto", threads: int = 1,
                   prepared: Optional[PreparedFast] = None):
    """-> (encoder, note). ``auto``: gigatoken when exact on the sample, else the reference with a
    one-line note why; ``gigatoken``: the same check, but a mismatch is an error; ``reference``.
    ``prepared``: gigatoken and its sample ids from :class:`PreparedFast` (started before ``tok`` loaded)."""
    if backend not in BACKENDS:
        raise DataError(f"--backend {backend!r} unknown; use one of {BACKENDS}")
    reference = ReferenceEncoder(tok)
    if backend == "reference":
        return reference, "backend: reference (as asked)"
    try:
        # sentencepiece treats control-piece text as plain text; gigatoken's port does not
        reroute = special_strings(tok) if tok.kind == "sentencepiece" else ()
        gt, sample_ids = prepared.result() if prepared is not None else (load_gigatoken(tok), None)
        fast = GigatokenEncoder(gt, 1, reference, reroute)
        probes = [(f"probe {i + 1} (built-in check text)", t) for i, t in enumerate(PROBES)]
        probes += [(f"probe {len(PROBES) + i + 1} (special-token text)", t) for i, t in enumerate(special_probes(tok))]
        why = None
        if sample_ids is not None and reroute and any(s in t for _, t in sample for s in reroute):
            sample_ids = None  # rerouted documents in the sample: let the full encoder (with reroute) redo it
        if sample:
            why = first_mismatch(reference, fast, list(sample), sample_ids)
        why = why or first_mismatch(reference, fast, probes)
    except DataError as exc:
        why = str(exc)
    if why is None:
        fast.threads = max(1, int(threads))
        return fast, f"backend: gigatoken (ids equal the reference on {len(sample)} sampled documents + probes)"
    if backend == "gigatoken":
        raise DataError(f"--backend gigatoken does not reproduce tokenizer {tok.path}: {why}; use --backend auto")
    return reference, f"backend: reference tokenizer, not gigatoken: {why}"
