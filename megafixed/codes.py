"""Fixed token codes: the input interface that replaces a trainable embedding table.

THE CONVENTION (fixed forever: checkpoints and exported models depend on it)
---------------------------------------------------------------------------
For a token id ``t`` and a code of ``bits`` bits:

* ``bits(t)[i] = (t >> i) & 1`` -- least significant bit first, ``i = 0 .. bits-1``.
* The (optionally recoded) code bit is ``c[i] = (A . bits(t))[i] XOR b[i]`` over GF(2),
  i.e. ``c[i] = parity(row_i(A) AND t) XOR b_i`` where ``row_i(A)`` is row ``i`` of ``A``
  packed LSB-first into an integer (bit ``j`` of the row integer is ``A[i][j]``).
  The canonical code is ``A = I``, ``b = 0``.
* Bit 1 maps to ``+scale`` and bit 0 maps to ``-scale`` (``scale`` defaults to 1.0).
* Column ``j`` of a width-``d`` output uses code bit ``j mod bits``: the code is tiled to the
  model width. ``d`` need not be a multiple of ``bits``, but ``d < bits`` is rejected because the
  code would no longer be injective.

Everything here is plain torch on any device; the Triton kernel in ``megafixed.kernels``
reproduces :meth:`FixedCode.encode` bit for bit and is the path the model takes on CUDA.
We write our own GF(2) elimination because it is ~30 lines over integer bitmasks and no
maintained Python library offers GL(n, 2) inversion without a heavy dependency (galois/numba).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch

CODE_FORMAT_VERSION = 1
MAX_BITS = 31  # ids travel as int32 in the kernel; 31 bits keeps every id non-negative


class CodeError(ValueError):
    """Raised for any invalid code parameter or out-of-range input; the message names the fix."""


def bits_needed(vocab_size: int) -> int:
    """Smallest number of code bits that gives every id in ``range(vocab_size)`` its own code."""
    if int(vocab_size) < 1:
        raise CodeError(f"vocab_size must be >= 1, got {vocab_size}")
    return max(1, math.ceil(math.log2(int(vocab_size))))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_bits(bits: int) -> int:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= MAX_BITS:
        raise CodeError(f"code bits must be an integer in 1..{MAX_BITS}, got {bits!r}")
    return bits


def _rows_from_matrix(A: Any, bits: int) -> list[int]:
    """Accept a bits x bits 0/1 matrix (nested lists, numpy or torch) and pack each row LSB-first."""
    try:
        mat = torch.as_tensor(A).tolist() if not isinstance(A, list) else A
    except Exception as exc:  # pragma: no cover - exotic input types
        raise CodeError(f"GF(2) matrix A must be a {bits}x{bits} array of 0/1: {exc}") from exc
    if len(mat) != bits or any(not isinstance(r, (list, tuple)) or len(r) != bits for r in mat):
        raise CodeError(f"GF(2) matrix A must have shape ({bits}, {bits}); pass bits={len(mat)} "
                        f"or a matrix of the right shape")
    rows = []
    for i, row in enumerate(mat):
        packed = 0
        for j, v in enumerate(row):
            if v not in (0, 1, True, False):
                raise CodeError(f"GF(2) matrix A[{i}][{j}] = {v!r}; entries must be 0 or 1")
            packed |= int(v) << j
        rows.append(packed)
    return rows


def _shift_from_bits(b: Any, bits: int) -> int:
    if b is None:
        return 0
    if _is_int(b):
        if not 0 <= b < (1 << bits):
            raise CodeError(f"shift b = {b} does not fit in {bits} bits; use 0 <= b < 2**{bits}")
        return b
    vals = torch.as_tensor(b).tolist()
    if _is_int(vals):  # a numpy / 0-d tensor integer: same as a packed int
        return _shift_from_bits(vals, bits)
    if not isinstance(vals, list) or len(vals) != bits or any(v not in (0, 1) for v in vals):
        raise CodeError(f"shift b must be an int or {bits} bits of 0/1, got {vals!r}")
    return sum(int(v) << i for i, v in enumerate(vals))


def gf2_inverse(rows: Sequence[int], bits: int) -> list[int]:
    """Invert a GF(2) matrix given as LSB-first packed rows by Gauss-Jordan elimination.

    Raises :class:`CodeError` naming the rank when the matrix is singular.
    """
    a = list(rows)
    inv = [1 << i for i in range(bits)]
    rank = 0
    for col in range(bits):
        pivot = next((r for r in range(rank, bits) if (a[r] >> col) & 1), None)
        if pivot is None:
            continue
        a[rank], a[pivot] = a[pivot], a[rank]
        inv[rank], inv[pivot] = inv[pivot], inv[rank]
        for r in range(bits):
            if r != rank and (a[r] >> col) & 1:
                a[r] ^= a[rank]
                inv[r] ^= inv[rank]
        rank += 1
    if rank < bits:
        raise CodeError(f"GF(2) matrix A is singular (rank {rank} < {bits}): two token ids would "
                        f"share a code. Pass an invertible matrix, or use FixedCode.gf2(seed=...) "
                        f"to draw one")
    # After elimination a is a permutation-free identity (pivots were placed in column order).
    return inv


_MASK64 = (1 << 64) - 1


def splitmix64(seed: int):
    """Yield the SplitMix64 stream for ``seed`` (Steele, Lea & Flood 2014), as plain Python ints.

    ``state += 0x9E3779B97F4A7C15``; ``z = state``; ``z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9``;
    ``z = (z ^ z >> 27) * 0x94D049BB133111EB``; output ``z ^ z >> 31``; all modulo 2**64. Seed 0
    starts 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4. Written out here rather than taken from a
    library because a code must come from its seed identically on every version of everything.
    """
    try:  # numpy and 0-d tensor integers are seeds too; floats and bools are mistakes
        state = operator.index(seed) if not isinstance(seed, bool) else None
    except TypeError:
        state = None
    if state is None or not 0 <= state <= _MASK64:
        raise CodeError(f"code seed must be an integer in [0, 2**64), got {seed!r}")
    while True:
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        yield z ^ (z >> 31)


def gf2_draw(bits: int, seed: int, affine: bool = True) -> tuple[list[int], int]:
    """Draw ``(rows of A, b)`` for a seeded GF(2) recoding; THE procedure behind ``FixedCode.gf2``.

    1. Start SplitMix64 (:func:`splitmix64`) with state ``seed`` (an integer in [0, 2**64)).
    2. Candidate ``A``: for ``i = 0 .. bits-1``, row ``i`` = next output ``& (2**bits - 1)``
       (packed LSB-first: bit ``j`` is ``A[i][j]``).
    3. If the candidate is singular over GF(2) (rank < ``bits`` by Gauss-Jordan elimination,
       :func:`gf2_rank`), discard the whole matrix and go back to 2, continuing the same stream.
    4. ``b`` = next output ``& (2**bits - 1)`` if ``affine``, else 0 (no output is consumed).

    Every bit matrix is equally likely at step 2 and step 3 keeps exactly the invertible ones, so
    ``A`` is uniform over GL(bits, 2) (about 29% of candidates pass: a few draws on average).
    """
    _check_bits(bits)
    stream = splitmix64(seed)
    low = (1 << bits) - 1
    while True:
        rows = [next(stream) & low for _ in range(bits)]
        if gf2_rank(rows, bits) == bits:
            break
    shift = next(stream) & low if affine else 0
    return rows, shift


def gf2_rank(rows: Sequence[int], bits: int) -> int:
    """Rank over GF(2) of a ``bits``-column matrix given as LSB-first packed rows."""
    a = list(rows)
    rank = 0
    for col in range(bits):
        pivot = next((r for r in range(rank, len(a)) if (a[r] >> col) & 1), None)
        if pivot is None:
            continue
        a[rank], a[pivot] = a[pivot], a[rank]
        for r in range(len(a)):
            if r != rank and (a[r] >> col) & 1:
                a[r] ^= a[rank]
        rank += 1
    return rank


def _parity(x: torch.Tensor) -> torch.Tensor:
    """Parity of each int64 element (x >= 0), by xor folding -- the same trick the kernel uses."""
    for shift in (32, 16, 8, 4, 2, 1):
        x = x ^ (x >> shift)
    return x & 1


def tile_code(values: torch.Tensor, width: int) -> torch.Tensor:
    """Tile ``values [..., bits]`` to ``[..., width]``: column ``j`` is ``values[..., j % bits]``.

    Why not ``values[..., arange(width) % bits]``: that is a gather (an index read per output
    element) and measured 0.6x ``F.embedding`` on CPU. Copying a stride-0 broadcast of the code
    into whole tiles is a pure write stream (one contiguous pass over the output, as
    ``Tensor.repeat`` does). A 16-bit code in bf16 is only 32 bytes, though, and copies in such
    short runs cost more in loop overhead than in bytes (0.5x ``F.embedding`` at 4,096 x 1,024 bf16):
    short codes first fill a ~512-byte head of each row, and the rest of the row is copied from
    that head (just written, so in cache) in 512-byte runs.
    """
    nbits = values.shape[-1]
    width = int(width)
    out = values.new_empty(*values.shape[:-1], width)
    flat, v = out.view(-1, width), values.reshape(-1, nbits)
    reps = width // nbits
    head = nbits * max(1, min(reps, 512 // (nbits * values.element_size()))) if nbits * values.element_size() < 64 \
        else nbits * reps  # a code of 64+ bytes: one pass of whole tiles
    flat[:, :head].view(-1, head // nbits, nbits).copy_(v[:, None, :].expand(-1, head // nbits, nbits))
    # Column c holds bit c % bits, and head is a multiple of bits: column c equals column c % head.
    q, tail = divmod(width - head, head)
    if q:
        flat[:, head: head + q * head].view(-1, q, head).copy_(flat[:, None, :head].expand(-1, q, head))
    if tail:  # the last partial run (and a partial last tile when bits does not divide width)
        flat[:, width - tail:] = flat[:, :tail]
    return out


@dataclass(frozen=True)
class FixedCode:
    """A fixed, parameter-free map from token ids to +-scale codes (see the module docstring)."""

    bits: int
    rows: tuple[int, ...]  # A, packed LSB-first per row; identity for canonical
    shift: int = 0  # b, packed LSB-first
    scale: float = 1.0
    kind: str = "canonical"
    seed: int | None = None

    def __post_init__(self):
        _check_bits(self.bits)
        if len(self.rows) != self.bits:
            raise CodeError(f"expected {self.bits} rows of A, got {len(self.rows)}")
        # A row outside [0, 2**bits) is not a row of a bits x bits matrix (and would not fit the
        # kernel's int32 rows); elimination alone would not notice stray high or sign bits.
        bad_rows = [r for r in self.rows if not _is_int(r) or not 0 <= r < (1 << self.bits)]
        if bad_rows:
            raise CodeError(f"rows of A must be ints in [0, 2**{self.bits}) (row i packs A[i][j] at "
                            f"bit j), got {bad_rows[:3]!r}")
        if not 0 <= self.shift < (1 << self.bits):
            raise CodeError(f"shift b = {self.shift} does not fit in {self.bits} bits")
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale > 0):
            raise CodeError(f"scale must be a finite positive number, got {self.scale!r}")
        if self.kind not in ("canonical", "gf2"):
            raise CodeError(f"code kind must be 'canonical' or 'gf2', got {self.kind!r}")
        # Proves invertibility (raises if singular) and caches A^-1 for decode.
        object.__setattr__(self, "_inv_rows", tuple(gf2_inverse(self.rows, self.bits)))

    # ----------------------------------------------------------------------------- constructors
    @classmethod
    def canonical(cls, bits: int = 16, scale: float = 1.0) -> "FixedCode":
        _check_bits(bits)
        return cls(bits=bits, rows=tuple(1 << i for i in range(bits)), shift=0, scale=float(scale))

    @classmethod
    def gf2(cls, bits: int = 16, seed: int | None = 0, affine: bool = True, A: Any = None,
            b: Any = None, scale: float = 1.0) -> "FixedCode":
        """GF(2) affine recoding ``c' = A.c XOR b``.

        With ``A`` omitted, ``A`` and ``b`` are drawn from ``seed`` by :func:`gf2_draw`: a procedure
        written out in full there (SplitMix64, rejection of singular matrices) that depends on no
        library's random stream, so a seed names the same code everywhere, forever. In short:
        SplitMix64 with state ``seed``; row ``i`` of a candidate ``A`` is the low ``bits`` bits of
        the next output; a singular candidate is discarded whole and a new one drawn; then
        ``b`` is the low ``bits`` bits of the next output if ``affine``, else 0.
        """
        _check_bits(bits)
        if A is None:
            if seed is None:
                raise CodeError("FixedCode.gf2 needs either a seed or an explicit matrix A")
            rows, shift = gf2_draw(bits, seed, affine)
        else:
            rows = _rows_from_matrix(A, bits)
            shift = _shift_from_bits(b, bits) if affine else 0
            if not affine and b is not None:
                raise CodeError("a shift b was given with affine=False; drop b or set affine=True")
        return cls(bits=bits, rows=tuple(rows), shift=shift, scale=float(scale), kind="gf2",
                   seed=None if A is not None else int(seed))

    # ----------------------------------------------------------------------------- properties
    @property
    def matrix(self) -> torch.Tensor:
        """A as a dense ``bits x bits`` uint8 tensor (``A[i, j]`` = bit j of row i)."""
        r = torch.tensor(self.rows, dtype=torch.int64)
        return ((r[:, None] >> torch.arange(self.bits)) & 1).to(torch.uint8)

    @property
    def inverse_matrix(self) -> torch.Tensor:
        r = torch.tensor(self._inv_rows, dtype=torch.int64)
        return ((r[:, None] >> torch.arange(self.bits)) & 1).to(torch.uint8)

    @property
    def shift_bits(self) -> torch.Tensor:
        return ((torch.tensor(self.shift) >> torch.arange(self.bits)) & 1).to(torch.uint8)

    @property
    def is_identity(self) -> bool:
        return self.shift == 0 and all(r == 1 << i for i, r in enumerate(self.rows))

    # ----------------------------------------------------------------------------- checks
    def check_vocab(self, vocab_size: int) -> None:
        if int(vocab_size) > (1 << self.bits):
            raise CodeError(f"vocab_size {vocab_size} needs {bits_needed(vocab_size)} code bits but the "
                            f"code has {self.bits} (max vocab {1 << self.bits}); raise model.code_bits "
                            f"or use a smaller tokenizer")

    def check_width(self, width: int) -> None:
        if int(width) < self.bits:
            raise CodeError(f"width {width} < code bits {self.bits}: a tiled code narrower than its "
                            f"bit count is not injective; use width >= {self.bits}")

    def check_ids(self, ids: torch.Tensor) -> None:
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
            raise CodeError(f"token ids must be an integer tensor, got {ids.dtype}")
        if ids.numel() == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= (1 << self.bits):
            bad = lo if lo < 0 else hi
            raise CodeError(f"token id {bad} is outside [0, {(1 << self.bits) - 1}] for a {self.bits}-bit "
                            f"code; check the tokenizer's vocab against model.code_bits")

    # ----------------------------------------------------------------------------- math
    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows of A, bits of b, arange(bits)) as int64 on ``device``, built once per device: a
        host-to-device copy per call is a sync on CUDA and most of the time of a small CPU call."""
        cache = self.__dict__.setdefault("_const_cache", {})
        key = str(device)
        if key not in cache:
            ar = torch.arange(self.bits, dtype=torch.int64, device=device)
            cache[key] = (torch.tensor(self.rows, dtype=torch.int64, device=device),
                          (torch.tensor(self.shift, dtype=torch.int64, device=device) >> ar) & 1, ar)
        return cache[key]

    def code_bits(self, ids: torch.Tensor) -> torch.Tensor:
        """The recoded bits ``A.bits(t) XOR b`` as an int64 tensor of shape ``ids.shape + (bits,)``."""
        ids = ids.to(torch.int64)
        rows, shift, ar = self._constants(ids.device)
        if self.is_identity:  # A = I, b = 0: parity(t & (1 << i)) is bit i of t itself
            return (ids[..., None] >> ar) & 1
        return _parity(ids[..., None] & rows) ^ shift

    def encode(self, ids: torch.Tensor, width: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None, validate: bool = True) -> torch.Tensor:
        """Codes of shape ``ids.shape + (width,)`` with values exactly ``+-scale``."""
        ids = torch.as_tensor(ids)
        if device is not None:
            ids = ids.to(device)
        self.check_width(width)
        if validate:
            self.check_ids(ids)
        return tile_code(self._code_values(ids, dtype), width)

    def _code_values(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The bits-wide values ``ids.shape + (bits,)``: exactly ``((2 c - 1) * scale in fp32).to(dtype)``.

        Computed a byte at a time: the code word ``A t XOR b`` is linear over GF(2), so it is the XOR of
        one 256-entry lookup per byte of ``t`` (table ``j`` holds ``A (x << 8j)``), and the values of a
        code byte come from one ``[256, 8]`` value table. A few int64 ops per token instead of ~15 per
        code bit (``code_bits``), which on CPU cost as much as writing the output. Tables are tiny and
        per code, not per vocabulary; values are rounded by the same formula, so nothing changes.
        """
        word_tables, value_table = self._byte_tables(ids.device, dtype)
        t = ids.to(torch.int64) & ((1 << self.bits) - 1)  # unvalidated ids: only the low bits count
        chunks = (self.bits + 7) // 8
        if self.is_identity:
            word = t
        else:
            word = torch.full_like(t, self.shift)
            for j in range(chunks):
                word ^= word_tables[j][(t >> (8 * j)) & 255]
        byte_idx = (word[..., None] >> (8 * torch.arange(chunks, device=ids.device))) & 255
        values = value_table[byte_idx].flatten(-2)  # [..., chunks * 8]
        return values if values.shape[-1] == self.bits else values[..., : self.bits]

    def _byte_tables(self, device: torch.device, dtype: torch.dtype) -> tuple[list, torch.Tensor]:
        """(per-byte code-word tables, the [256, 8] value table), built once per device and dtype."""
        cache = self.__dict__.setdefault("_byte_cache", {})
        key = (str(device), dtype)
        if key not in cache:
            cols = [sum(((r >> k) & 1) << i for i, r in enumerate(self.rows)) for k in range(self.bits)]
            tables = []
            for j in range((self.bits + 7) // 8):
                tab = [0] * 256
                for x in range(1, 256):
                    low = (x & -x).bit_length() - 1  # lowest set bit: tab[x] = tab[x without it] ^ its column
                    k = 8 * j + low
                    tab[x] = tab[x & (x - 1)] ^ (cols[k] if k < self.bits else 0)
                tables.append(torch.tensor(tab, dtype=torch.int64, device=device))
            bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
            values = ((bits * 2 - 1).to(torch.float32) * self.scale).to(dtype).to(device)
            cache[key] = (tables, values)
        return cache[key]

    def decode(self, x: torch.Tensor, strict: bool = True) -> torch.Tensor:
        """Recover int64 ids from a code tensor (last dim = width).

        With ``strict`` the tiles are checked for agreement, so a tensor that is not a valid code
        is an error rather than a silently wrong id.
        """
        if x.shape[-1] < self.bits:
            raise CodeError(f"code tensor width {x.shape[-1]} < code bits {self.bits}")
        pos = (x > 0).to(torch.int64)
        first = pos[..., : self.bits]
        if strict:
            col = torch.arange(x.shape[-1], device=x.device) % self.bits
            if not torch.equal(pos, first[..., col]) or bool((x == 0).any()):
                raise CodeError("tensor is not a valid tiled code: tiles disagree or contain zeros")
        shift = (torch.tensor(self.shift, device=x.device) >> torch.arange(self.bits, device=x.device)) & 1
        c = first ^ shift
        packed = (c << torch.arange(self.bits, device=x.device)).sum(-1)
        inv = torch.tensor(self._inv_rows, dtype=torch.int64, device=x.device)
        out_bits = _parity(packed[..., None] & inv)
        return (out_bits << torch.arange(self.bits, device=x.device)).sum(-1)

    # ----------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict:
        return {"format_version": CODE_FORMAT_VERSION, "kind": self.kind, "bits": self.bits,
                "rows": list(self.rows), "shift": self.shift, "scale": self.scale, "seed": self.seed}

    @classmethod
    def from_state_dict(cls, sd: dict) -> "FixedCode":
        required = {"format_version", "kind", "bits", "rows", "shift", "scale"}
        if not isinstance(sd, dict):
            raise CodeError(f"code state dict must be a dict, got {type(sd).__name__}")
        missing = required - set(sd)
        if missing:
            raise CodeError(f"code state dict is missing {sorted(missing)}; it was not written by "
                            f"FixedCode.state_dict()")
        unknown = set(sd) - required - {"seed"}
        if unknown:
            raise CodeError(f"code state dict has unknown keys {sorted(unknown)}")
        if sd["format_version"] != CODE_FORMAT_VERSION:
            raise CodeError(f"code format_version {sd['format_version']} is not supported "
                            f"(this megafixed reads {CODE_FORMAT_VERSION})")
        rows = sd["rows"]
        if not isinstance(rows, (list, tuple)) or not all(_is_int(r) for r in rows):
            raise CodeError("code state dict 'rows' must be a list of ints (A's rows, LSB-first)")
        # No silent int()/float() coercion: a string or a truncated float here means a corrupt file.
        if not _is_int(sd["shift"]):
            raise CodeError(f"code state dict 'shift' must be an int (b, LSB-first), got {sd['shift']!r}")
        if not (isinstance(sd["scale"], (int, float)) and not isinstance(sd["scale"], bool)):
            raise CodeError(f"code state dict 'scale' must be a number, got {sd['scale']!r}")
        if sd.get("seed") is not None and not _is_int(sd["seed"]):
            raise CodeError(f"code state dict 'seed' must be an int or None, got {sd['seed']!r}")
        return cls(bits=sd["bits"], rows=tuple(rows), shift=sd["shift"], scale=float(sd["scale"]),
                   kind=sd["kind"], seed=sd.get("seed"))


def make_code(kind: str, bits: int = 16, seed: int = 0, affine: bool = True, scale: float = 1.0,
              rows: Sequence[int] | None = None, shift: int | None = None) -> FixedCode:
    """Build the code a model config names (``canonical`` or ``gf2``).

    For ``gf2``, explicit ``rows`` (A, LSB-first per row) and ``shift`` (b, default 0) are used
    as given and ``seed``/``affine`` are ignored: that is how a config pins its exact recoding.
    """
    if kind == "canonical":
        if rows is not None or shift is not None:
            raise CodeError("explicit rows/shift only apply to the gf2 code; drop them or use kind 'gf2'")
        return FixedCode.canonical(bits=bits, scale=scale)
    if kind == "gf2":
        if rows is None:
            if shift is not None:
                raise CodeError("a shift was given without rows; give both, or neither to draw from the seed")
            return FixedCode.gf2(bits=bits, seed=seed, affine=affine, scale=scale)
        _check_bits(bits)
        return FixedCode(bits=bits, rows=tuple(rows), shift=0 if shift is None else shift,
                         scale=float(scale), kind="gf2", seed=None)
    raise CodeError(f"unknown code kind {kind!r}; use 'canonical' or 'gf2'")


__all__ = ["FixedCode", "CodeError", "bits_needed", "tile_code", "gf2_draw", "gf2_inverse", "gf2_rank", "make_code",
           "splitmix64", "CODE_FORMAT_VERSION"]
