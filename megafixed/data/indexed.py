"""Megatron's ``.bin/.idx`` token shards: an exact writer, a validating memmap reader, and merge.

Layout (little-endian), byte-compatible with ``megatron.core.datasets.indexed_dataset``:

    .idx  b"MMIDIDX\\x00\\x00" | <Q version=1 | <B dtype code | <Q sequence count n | <Q document count d
          | int32 lengths[n] | int64 byte pointers[n] | int64 document indices[d]   (d = docs + 1, starts at 0)
    .bin  the tokens of every sequence, back to back, in the .idx dtype

We write one sequence per document (GPT style). We pick uint16 for every vocabulary up to 65,536
ids (Megatron switches to int32 at 65,500, doubling the disk and page-cache cost for no reason);
megatron-core reads the dtype from the header, so it reads our uint16 shards either way.

Megatron's own builder keeps every length in a Python list and writes pointers with a Python loop;
ours streams numpy arrays, and a writer only ever renames complete files into place (``.bin`` first,
``.idx`` last), so a crash or Ctrl-C never leaves a complete-looking but wrong pair.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import struct
from typing import Iterable, Optional

import numpy as np

from ..atomic import atomic_write_text
from .errors import ShardError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
DTYPE_BY_CODE = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                 7: np.float32, 8: np.uint16}
CODE_BY_DTYPE = {np.dtype(v): k for k, v in DTYPE_BY_CODE.items()}
TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.int32), np.dtype(np.int64))


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def meta_path(prefix: str) -> str:
    """Our sidecar (tokenizer, counts, bad-input report); Megatron ignores it."""
    return prefix + ".meta.json"


def prefix_files(prefix: str) -> list[str]:
    """Every existing file a prefix owns: PREFIX.bin/.idx/.meta.json and a sharded set's
    PREFIX_00000.* ... (what writing PREFIX would replace)."""
    own = [p for p in (bin_path(prefix), idx_path(prefix), meta_path(prefix)) if os.path.lexists(p)]
    shards = glob.glob(glob.escape(prefix) + "_[0-9][0-9][0-9][0-9][0-9].*")
    return own + sorted(p for p in shards if p.endswith((".bin", ".idx", ".meta.json")))


def shard_exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Smallest token dtype that holds ids 0..vocab_size-1: uint16 up to 65,536 ids, else int32."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 31:
        return np.dtype(np.int32)
    raise ShardError(f"vocab_size={vocab_size} does not fit int32 token ids")


# ----------------------------------------------------------------------------------- writing
def _write_index(path: str, dtype: np.dtype, lengths: np.ndarray, doc_indices: np.ndarray) -> None:
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    with open(path, "wb") as fh:
        fh.write(MAGIC)
        fh.write(struct.pack("<Q", VERSION))
        fh.write(struct.pack("<B", CODE_BY_DTYPE[dtype]))
        fh.write(struct.pack("<Q", len(lengths)))
        fh.write(struct.pack("<Q", len(doc_indices)))
        fh.write(lengths.tobytes(order="C"))
        fh.write(pointers.tobytes(order="C"))
        fh.write(np.ascontiguousarray(doc_indices, dtype=np.int64).tobytes(order="C"))


def _write_index_streamed(path: str, dtype: np.dtype, lengths_file: str, n: int, chunk: int = 1 << 22) -> None:
    """The same bytes as :func:`_write_index` for one sequence per document, from lengths kept on disk
    (int32, ``n`` of them), a chunk at a time: memory stays flat however many documents a shard holds."""
    lengths = np.memmap(lengths_file, mode="r", dtype=np.int32, shape=(n,)) if n else np.zeros(0, np.int32)
    with open(path, "wb") as fh:
        fh.write(MAGIC)
        fh.write(struct.pack("<Q", VERSION))
        fh.write(struct.pack("<B", CODE_BY_DTYPE[dtype]))
        fh.write(struct.pack("<Q", n))
        fh.write(struct.pack("<Q", n + 1))
        for a in range(0, n, chunk):
            fh.write(np.ascontiguousarray(lengths[a:a + chunk]).tobytes(order="C"))
        start = 0  # byte pointers: the running sum of the lengths before each sequence
        for a in range(0, n, chunk):
            part = np.asarray(lengths[a:a + chunk], dtype=np.int64) * dtype.itemsize
            ptr = np.cumsum(part) - part + start
            fh.write(ptr.tobytes(order="C"))
            start = int(ptr[-1] + part[-1])
        for a in range(0, n + 1, chunk):
            fh.write(np.arange(a, min(n + 1, a + chunk), dtype=np.int64).tobytes(order="C"))
    del lengths


def _commit(prefix: str, tmp_bin: str, tmp_idx: str, meta: Optional[dict]) -> None:
    """Rename into place: drop any old .idx first so an old index never pairs with a new .bin."""
    for stale in (idx_path(prefix), meta_path(prefix)):
        if os.path.exists(stale):
            os.remove(stale)
    os.replace(tmp_bin, bin_path(prefix))
    if meta is not None:
        atomic_write_text(meta_path(prefix), json.dumps(meta, indent=1))
    os.replace(tmp_idx, idx_path(prefix))


class ShardWriter:
    """Stream documents into one ``prefix.bin/.idx`` pair; ``finalize()`` makes it visible.

    Use as a context manager: an exception (including KeyboardInterrupt) deletes the temp files.
    """

    def __init__(self, prefix: str, dtype: np.dtype | type):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in TOKEN_DTYPES:
            raise ShardError(f"token dtype {self.dtype} unsupported; use one of {[str(d) for d in TOKEN_DTYPES]}")
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._tmp_bin = f"{bin_path(prefix)}.tmp.{os.getpid()}"
        self._tmp_idx = f"{idx_path(prefix)}.tmp.{os.getpid()}"
        self._tmp_len = f"{idx_path(prefix)}.lengths.tmp.{os.getpid()}"
        self._fh = open(self._tmp_bin, "wb")
        # document lengths go to disk as they come (4 bytes a document would otherwise pile up in memory)
        self._len_fh = open(self._tmp_len, "wb")
        self.num_docs = 0
        self.num_tokens = 0
        self._limit = np.iinfo(self.dtype).max

    @property
    def bytes_written(self) -> int:
        return self.num_tokens * self.dtype.itemsize

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one flat token array and the length of each document."""
        tokens = np.asarray(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != tokens.size:
            raise ShardError(f"{self.prefix}: lengths sum to {int(lengths.sum())} but {tokens.size} tokens given")
        if tokens.size and (int(tokens.max()) > self._limit or int(tokens.min()) < 0):
            raise ShardError(f"{self.prefix}: token id {int(tokens.max())} does not fit {self.dtype}; "
                             f"write with a wider dtype (the tokenizer's vocab_size decides it)")
        if lengths.size and int(lengths.max()) >= 1 << 31:
            raise ShardError(f"{self.prefix}: a document of {int(lengths.max())} tokens exceeds the int32 "
                             f"length field of the .idx format; split it")
        self._fh.write(tokens.astype(self.dtype, copy=False).tobytes(order="C"))
        self._len_fh.write(lengths.astype(np.int32).tobytes(order="C"))
        self.num_docs += len(lengths)
        self.num_tokens += tokens.size

    def add_document(self, tokens: Iterable[int]) -> None:
        arr = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens, dtype=np.int64)
        self.add_documents(arr, np.array([arr.size]))

    def finalize(self, meta: Optional[dict] = None) -> None:
        self._fh.close()
        self._len_fh.close()
        _write_index_streamed(self._tmp_idx, self.dtype, self._tmp_len, self.num_docs)
        os.remove(self._tmp_len)
        _commit(self.prefix, self._tmp_bin, self._tmp_idx, meta)

    def abort(self) -> None:
        for fh in (self._fh, self._len_fh):
            if not fh.closed:
                fh.close()
        for p in (self._tmp_bin, self._tmp_idx, self._tmp_len):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


# ----------------------------------------------------------------------------------- reading
class IndexedShard:
    """Read-only view of one ``.bin/.idx`` pair, validated at open.

    Open checks: both files exist, magic/version/dtype, the .idx size matches its header, pointers
    are contiguous, document indices are sane, and the .bin holds exactly the bytes the .idx
    describes. Anything else raises :class:`ShardError` naming the file.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._tokens = None
        self._open_index()
        self._validate()

    # pickling (DataLoader workers): reopen the memmaps on the other side, never ship the arrays
    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.__init__(state["prefix"])

    def _open_index(self) -> None:
        ip, bp = idx_path(self.prefix), bin_path(self.prefix)
        for p in (ip, bp):
            if not os.path.isfile(p):
                raise ShardError(f"shard file {p} not found; run `megafixed preprocess --output-prefix "
                                 f"{self.prefix} ...` to create it (or fix data.prefixes)")
        size = os.path.getsize(ip)
        if size < HEADER_BYTES:
            raise ShardError(f"{ip} is truncated ({size} bytes, header needs {HEADER_BYTES}); re-run preprocessing")
        with open(ip, "rb") as fh:
            head = fh.read(HEADER_BYTES)
        if head[:9] != MAGIC:
            raise ShardError(f"{ip} is not a Megatron index (magic {head[:9]!r}, expected {MAGIC!r}); "
                             f"the file is corrupt or not an .idx")
        version, = struct.unpack("<Q", head[9:17])
        if version != VERSION:
            raise ShardError(f"{ip} has index version {version}; only version {VERSION} is supported")
        code = head[17]
        if code not in DTYPE_BY_CODE or np.dtype(DTYPE_BY_CODE[code]).kind not in "iu":
            raise ShardError(f"{ip} has dtype code {code}, which is not an integer token dtype "
                             f"(valid codes: {sorted(DTYPE_BY_CODE)}); the file is corrupt")
        self.dtype = np.dtype(DTYPE_BY_CODE[code])
        n, d = struct.unpack("<QQ", head[18:34])
        expected = HEADER_BYTES + n * 4 + n * 8 + d * 8
        # multimodal Megatron indices append one int8 mode per sequence; we ignore the modes
        if size not in (expected, expected + n):
            raise ShardError(f"{ip} is {size} bytes but its header ({n} sequences, {d} document "
                             f"indices) needs {expected}; the index is truncated or corrupt, re-run preprocessing")
        buf = np.memmap(ip, mode="r", dtype=np.uint8) if size else np.zeros(0, np.uint8)
        self.lengths = np.frombuffer(buf, dtype=np.int32, count=n, offset=HEADER_BYTES)
        self.pointers = np.frombuffer(buf, dtype=np.int64, count=n, offset=HEADER_BYTES + 4 * n)
        self.doc_indices = np.frombuffer(buf, dtype=np.int64, count=d, offset=HEADER_BYTES + 12 * n)

    def _validate(self) -> None:
        ip, bp = idx_path(self.prefix), bin_path(self.prefix)
        n = len(self.lengths)
        di = self.doc_indices
        if len(di) == 0 or di[0] != 0 or di[-1] != n or (len(di) > 1 and np.any(np.diff(di) < 0)):
            raise ShardError(f"{ip} has inconsistent document indices (must rise from 0 to {n}); corrupt index")
        if n and int(self.lengths.min()) < 0:
            raise ShardError(f"{ip} has negative sequence lengths; corrupt index")
        item = self.dtype.itemsize
        if n:
            expected = self.pointers[:-1] + self.lengths[:-1].astype(np.int64) * item
            if self.pointers[0] != 0 or np.any(self.pointers[1:] != expected):
                raise ShardError(f"{ip}: sequence pointers are not contiguous in {bp}; corrupt index")
        need = int(self.pointers[-1]) + int(self.lengths[-1]) * item if n else 0
        have = os.path.getsize(bp)
        if have < need:
            raise ShardError(f"{bp} is truncated: {have} bytes, but {ip} describes {need}; "
                             f"re-run preprocessing (the write was probably interrupted)")
        if have > need:
            raise ShardError(f"{bp} has {have - need} bytes more than {ip} describes ({need}); "
                             f"the pair does not belong together, re-run preprocessing")
        self.num_tokens = need // item

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the shard as one flat (lazy) memmap."""
        if self._tokens is None:
            if self.num_tokens == 0:
                self._tokens = np.zeros(0, dtype=self.dtype)
            else:
                self._tokens = np.memmap(bin_path(self.prefix), mode="r", dtype=self.dtype, shape=(self.num_tokens,))
        return self._tokens

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def num_documents(self) -> int:
        return len(self.doc_indices) - 1

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.lengths[i])]

    def document(self, i: int) -> np.ndarray:
        s0, s1 = int(self.doc_indices[i]), int(self.doc_indices[i + 1])
        if s1 == s0:
            return np.zeros(0, dtype=self.dtype)
        start = int(self.pointers[s0]) // self.dtype.itemsize
        end = int(self.pointers[s1 - 1]) // self.dtype.itemsize + int(self.lengths[s1 - 1])
        return self.tokens[start:end]

    def meta(self) -> dict:
        try:
            with open(meta_path(self.prefix)) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return {}


# ----------------------------------------------------------------------------------- merging
def merge_shards(prefixes: list[str], output_prefix: str, chunk_tokens: int = 1 << 24) -> dict:
    """Concatenate shards into one pair; documents keep their order. Mixed dtypes widen."""
    if not prefixes:
        raise ShardError("merge needs at least one input prefix")
    shards = [IndexedShard(p) for p in prefixes]
    metas = [s.meta() for s in shards]
    # Token ids from different tokenizers mean different things; merging them silently would train
    # on garbage. Shards without our sidecar (e.g. Megatron's own) carry no tokenizer to compare.
    named = [(p, m["tokenizer"], m.get("tokenizer_sha256")) for p, m in zip(prefixes, metas) if m.get("tokenizer")]
    for p, tok, sha in named[1:]:
        # same path but other file contents (a tokenizer retrained in place) is a different tokenizer too
        if tok != named[0][1] or (sha and named[0][2] and sha != named[0][2]):
            raise ShardError(f"cannot merge {named[0][0]!r} and {p!r}: they were tokenized with different "
                             f"tokenizers ({named[0][1]} vs {tok}); re-tokenize them with one tokenizer first")
    dtype = shards[0].dtype
    for s in shards[1:]:
        dtype = np.promote_types(dtype, s.dtype)
    if dtype not in TOKEN_DTYPES:
        dtype = np.dtype(np.int64) if dtype.itemsize > 4 else np.dtype(np.int32)
    out_bin = f"{bin_path(output_prefix)}.tmp.{os.getpid()}"
    out_idx = f"{idx_path(output_prefix)}.tmp.{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    lengths, docs, offset = [], [np.zeros(1, np.int64)], 0
    try:
        with open(out_bin, "wb") as out:
            for s in shards:
                if s.dtype == dtype:
                    with open(bin_path(s.prefix), "rb") as src:
                        shutil.copyfileobj(src, out, 1 << 22)
                else:
                    for a in range(0, s.num_tokens, chunk_tokens):
                        out.write(np.asarray(s.tokens[a:a + chunk_tokens]).astype(dtype).tobytes())
                lengths.append(np.asarray(s.lengths))
                docs.append(np.asarray(s.doc_indices[1:]) + offset)
                offset += s.num_sequences
        _write_index(out_idx, dtype, np.concatenate(lengths), np.concatenate(docs))
        meta = {"merged_from": [os.path.abspath(p) for p in prefixes], "dtype": str(dtype),
                "documents": int(offset)}
        # What the trainer and `data inspect` read from the sidecar (vocab for dtype and code-bit
        # checks, EOD, the tokenizer to decode with) carries over when every input agrees on it.
        for key in ("tokenizer", "tokenizer_sha256", "vocab_size", "eod_id", "append_eod"):
            values = [m.get(key) for m in metas]
            meta[key] = values[0] if all(v == values[0] for v in values) else None
        _commit(output_prefix, out_bin, out_idx, meta)
    except BaseException:
        for p in (out_bin, out_idx):
            if os.path.exists(p):
                os.remove(p)
        raise
    return {"prefix": output_prefix, "dtype": str(dtype), "documents": int(offset),
            "tokens": int(sum(s.num_tokens for s in shards))}
