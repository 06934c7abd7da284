"""Token ids -> tiled +-scale codes, written straight from the ids by a Triton kernel.

The kernel reproduces :meth:`megafixed.codes.FixedCode.encode` bit for bit (see the convention
in ``megafixed/codes.py``): code bit ``k = parity(row_k(A) & id) XOR b_k``, column ``j`` uses
``k = j % bits``, bit 1 -> ``+scale`` and bit 0 -> ``-scale``. The two output values are rounded
once on the host by torch, exactly as encode() rounds them, and the kernel stores their bit
patterns; there is no table of codes in memory: each program recomputes its bits from its ids.

Triton is optional (it ships in the ``kernels`` extra): without it, or for tensors that are not on
CUDA, :func:`token_codes` takes the plain-torch reference. ``force_kernel=True`` (or the env var
``MEGAFIXED_FORCE_TRITON=1``) runs the kernel on CPU tensors too, which works when
``TRITON_INTERPRET=1`` was set before Triton was first imported.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

from megafixed import env as env_vars
from megafixed.codes import MAX_BITS, CodeError, FixedCode

from .launch import KernelLaunch

try:  # Triton only exists in the `kernels` extra; the torch path must keep working without it.
    import triton
    import triton.language as tl
    _TRITON_IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = exc

HAVE_TRITON = triton is not None
# Output dtype -> the same-width integer type the kernel stores through (see _signed_patterns).
_STORE_AS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
             torch.float64: torch.int64}
KERNEL_DTYPES = tuple(_STORE_AS)
# Ids are handled as int32 in the kernel (MAX_BITS = 31 keeps a valid id non-negative there).
KERNEL_ID_DTYPES = (torch.int32, torch.int64)


if HAVE_TRITON:

    @triton.jit
    def parity(x):
        """Parity (0/1) of each int32 of ``x`` by xor folding (as codes._parity); x < 2**31, so 16
        is the widest fold. The one copy of the GF(2) dot product's last step for every kernel."""
        x = x ^ (x >> 16)
        x = x ^ (x >> 8)
        x = x ^ (x >> 4)
        x = x ^ (x >> 2)
        x = x ^ (x >> 1)
        return x & 1

    @triton.jit
    def code_bits_tile(ids, k, rows_ptr, mask_w, shift, CANONICAL: tl.constexpr):
        """Code bits (0/1) of ids [T] at code positions k [W] -> [T, W]; shared with the fused
        first-layer kernels so the code arithmetic exists once."""
        if CANONICAL:
            # A = I, b = 0: the code bit is the id bit itself.
            return (ids[:, None] >> k[None, :]) & 1
        row = tl.load(rows_ptr + k, mask=mask_w, other=0).to(tl.int32)
        return parity(ids[:, None] & row[None, :]) ^ ((shift >> k) & 1)[None, :]

    @triton.jit
    def _token_codes_kernel(ids_ptr, rows_ptr, out_ptr, n_tokens, width, shift, pos_pattern, neg_pattern,
                            BITS: tl.constexpr, CANONICAL: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
        # Roofline: pure store stream. Bytes written per token = width x element size; bytes read
        # = id size (4 or 8) + a few bytes of A's rows (cached), so the kernel is write-bound.
        pid_t = tl.program_id(0)
        pid_w = tl.program_id(1)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
        mask_t = offs_t < n_tokens
        mask_w = offs_w < width
        # Truncating int64 ids to int32 keeps bits 0..31, all a <= 31-bit code ever looks at.
        ids = tl.load(ids_ptr + offs_t, mask=mask_t, other=0).to(tl.int32)
        k = offs_w % BITS  # code bit of each column: the code is tiled across the width
        bit = code_bits_tile(ids, k, rows_ptr, mask_w, shift, CANONICAL)
        # Store the bit patterns of +scale / -scale that the host rounded with torch; out_ptr is the
        # output viewed as a same-width integer type, so no float rounding happens in here.
        val = tl.where(bit != 0, pos_pattern, neg_pattern)
        out_offs = offs_t[:, None].to(tl.int64) * width + offs_w[None, :]
        tl.store(out_ptr + out_offs, val.to(out_ptr.dtype.element_ty),
                 mask=mask_t[:, None] & mask_w[None, :])


def kernel_is_interpreted() -> bool:
    """True when the kernel was built under ``TRITON_INTERPRET=1`` (runs on CPU tensors)."""
    if not HAVE_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_token_codes_kernel, InterpretedFunction)


def _block_sizes(width: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_W, num_warps): ~8K outputs per program, rows of up to 512 contiguous columns.

    512 fp32 columns are 2 KiB of contiguous stores per token; narrow widths get more tokens per
    program to keep each program's work similar. The stores are 128-bit vectors (``st.global.v4.b32``)
    when ``width`` is divisible by 16, which the JIT then specialises on (every paper width; checked for
    sm_80/90/100 by tests/test_kernel_compile.py). Any other width stores one element per instruction:
    at 2,056 bf16, 32 ``st.global.b16`` per thread where 2,048 takes 4 vector stores, although its rows
    are 16-byte aligned (the JIT knows divisibility by 16 only). Such a width costs store throughput,
    not correctness; pick model widths that are multiples of 16 (docs/gpu.md).
    """
    block_w = min(512, triton.next_power_of_2(max(int(width), 1)))
    block_t = max(16, min(128, 8192 // block_w))
    num_warps = 8 if block_t * block_w >= 8192 else 4
    return block_t, block_w, num_warps


@functools.lru_cache(maxsize=64)
def _rows_on(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Cached: building it per call would be a blocking host-to-device copy on every forward.
    return torch.tensor(rows, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=64)
def _signed_patterns(scale: float, dtype: torch.dtype) -> tuple[int, int]:
    """Bit patterns (as signed ints of the store type) of ``+scale`` and ``-scale`` in ``dtype``.

    Computed exactly as encode() does (sign * scale in fp32, then torch's cast), so the kernel is
    bit-identical to encode() by construction. Rounding in the kernel instead would not be: Triton's
    CPU interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even (scale=0.1 differs).
    """
    vals = (torch.tensor([1.0, -1.0], dtype=torch.float32) * scale).to(dtype)
    pos, neg = vals.view(_STORE_AS[dtype]).tolist()
    return int(pos), int(neg)


def token_codes_reference(ids: torch.Tensor, code: FixedCode, width: int,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The plain-torch path: :meth:`FixedCode.encode` (the definition the kernel must match)."""
    return code.encode(ids, width, dtype=dtype)


def token_codes_launch(ids: torch.Tensor, code: FixedCode, width: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, Optional[KernelLaunch]]:
    """(output, launch) of :func:`token_codes_kernel`, allocation and arguments only (no checks, no
    launch; ``None`` for no tokens), so meta tensors give the compile-only check the real launch."""
    out = torch.empty(*ids.shape, width, dtype=dtype, device=ids.device)
    n_tokens = ids.numel()
    if n_tokens == 0:
        return out, None
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    rows = _rows_on(tuple(code.rows), ids.device)
    block_t, block_w, num_warps = _block_sizes(width)
    grid = (triton.cdiv(n_tokens, block_t), triton.cdiv(width, block_w))
    pos, neg = _signed_patterns(float(code.scale), dtype)
    return out, KernelLaunch(_token_codes_kernel, grid,
                             (flat, rows, out.view(_STORE_AS[dtype]), n_tokens, width, int(code.shift), pos, neg),
                             dict(BITS=code.bits, CANONICAL=code.is_identity, BLOCK_T=block_t, BLOCK_W=block_w,
                                  num_warps=num_warps))


def token_codes_kernel(ids: torch.Tensor, code: FixedCode, width: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Launch the Triton kernel. Does NOT validate the id range: :func:`token_codes` does that.

    Ids outside the code's range are not an error here: like encode(validate=False), only their
    low ``bits`` bits are looked at.
    """
    if not HAVE_TRITON:
        raise RuntimeError(f"the Triton token-code kernel needs triton (pip install "
                           f"'megafixed[kernels]'): {_TRITON_IMPORT_ERROR}")
    if dtype not in KERNEL_DTYPES:
        raise CodeError(f"the token-code kernel writes {[str(d) for d in KERNEL_DTYPES]}, not {dtype}; "
                        f"use one of those or token_codes_reference")
    if ids.dtype not in KERNEL_ID_DTYPES:
        raise CodeError(f"the token-code kernel reads int32 or int64 ids, got {ids.dtype}; "
                        f"convert with ids.long()")
    if code.bits > MAX_BITS:  # pragma: no cover - FixedCode already enforces this
        raise CodeError(f"code bits {code.bits} > {MAX_BITS}")
    if ids.device.type != "cuda" and not kernel_is_interpreted():
        raise RuntimeError(f"the Triton kernel got ids on {ids.device}: it needs CUDA tensors, or "
                           f"TRITON_INTERPRET=1 set before triton is first imported to run on CPU")
    code.check_width(width)
    out, launch = token_codes_launch(ids, code, width, dtype)
    if launch is None:
        return out  # nothing to write; a zero-size grid is not a valid launch
    # Triton launches on the current CUDA device; make that the ids' device (no-op on CPU).
    guard = torch.cuda.device(ids.device) if ids.is_cuda else contextlib.nullcontext()
    with guard:
        launch()
    return out


def _wants_kernel(ids: torch.Tensor, dtype: torch.dtype, force_kernel: bool) -> bool:
    if force_kernel or env_vars.force_triton():
        return True  # token_codes_kernel raises a clear error if it cannot run here
    return HAVE_TRITON and ids.is_cuda and dtype in KERNEL_DTYPES and ids.dtype in KERNEL_ID_DTYPES


def token_codes(ids: torch.Tensor, code: FixedCode, width: int, dtype: torch.dtype = torch.float32,
                force_kernel: bool = False, validate: bool = True) -> torch.Tensor:
    """Codes of shape ``ids.shape + (width,)``: the Triton kernel on CUDA, ``code.encode`` otherwise.

    ``validate`` checks the id range (one host sync for min/max) and raises :class:`CodeError`
    naming the bad id; pass ``validate=False`` on a hot path whose ids are known good. The output
    carries no gradient: codes are constants.
    """
    ids = torch.as_tensor(ids)
    code.check_width(width)
    if validate:
        code.check_ids(ids)
    if _wants_kernel(ids, dtype, force_kernel):
        return token_codes_kernel(ids, code, width, dtype)
    return code.encode(ids, width, dtype=dtype, validate=False)


__all__ = ["token_codes", "token_codes_reference", "token_codes_kernel", "kernel_is_interpreted",
           "HAVE_TRITON", "KERNEL_DTYPES"]
