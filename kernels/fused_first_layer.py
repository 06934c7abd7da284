"""The first block's input side, fused: normed QKV projection and residual add straight from token ids.

Why it works (``x0 = tile(c) * s``, the tiled +-s code of a token; ``c`` in {-1, +1}^bits):

* **RMSNorm of a +-s vector is a gamma-scaling.** Every entry of ``x0`` has magnitude ``s``, so
  ``mean(x0^2) = s^2`` and ``rmsnorm(x0) = x0 / sqrt(s^2 + eps) * gamma = alpha * tile(c) * gamma``
  with ``alpha = s / sqrt(s^2 + eps)`` (``s`` = the code value as rounded to the activation dtype).
* **tile(c) . W = c . fold(W).** Column ``j`` of the tiled code is ``c[j % bits]``, so
  ``(tile(c) * gamma) @ W.T = c @ fold(W * gamma).T`` where ``fold`` sums the input columns of
  ``W`` (``[out, d]``) in groups ``j % bits`` into ``[out, bits]``. The projection becomes a
  rank-``bits`` product: 16 multiply-adds per output instead of ``d``, and the code never exists.

So ``q|k|v = alpha * C @ F.T`` with ``C = [N, bits]`` (+-1) and ``F = fold([Wq; Wk; Wv] * gamma)``.
The fold is a weight-sized reduction done in torch (its gradient into W and gamma is then
autograd's); :func:`code_qkv` computes the product from ids (Triton kernel on CUDA, a torch
matmul with the bits-wide code elsewhere), and :func:`add_code` is the first residual add with
the code generated in the kernel's epilogue (``x1 = x0 + y`` without writing ``x0``).

Only RMSNorm folds this way (LayerNorm subtracts a per-token mean that depends on the code).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from megafixed.codes import FixedCode

from .launch import KernelLaunch
from .token_codes import HAVE_TRITON, _rows_on, _wants_kernel, kernel_is_interpreted, tl, triton

if HAVE_TRITON:
    from .token_codes import code_bits_tile, parity

if HAVE_TRITON:

    @triton.jit
    def _code_bits_of(ids, k, rows_ptr, shift, BITS: tl.constexpr, CANONICAL: tl.constexpr):
        """Code bit ``k`` (0/1, int32) of each id: the same arithmetic as the token-code kernel."""
        if CANONICAL:
            return (ids >> k) & 1
        row = tl.load(rows_ptr + k).to(tl.int32)
        return parity(ids & row) ^ ((shift >> k) & 1)

    @triton.jit
    def _code_qkv_kernel(ids_ptr, rows_ptr, f_ptr, out_ptr, n_tokens, n_out, shift, alpha,
                         BITS: tl.constexpr, CANONICAL: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_O: tl.constexpr):
        # out[n, o] = alpha * sum_k (2 c_k(id_n) - 1) * F[o, k]: a rank-BITS product accumulated in
        # fp32 with FMAs. The only large traffic is the [N, out] store; F (out x bits) stays in cache.
        pid_n = tl.program_id(0)
        pid_o = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
        mask_n = offs_n < n_tokens
        mask_o = offs_o < n_out
        ids = tl.load(ids_ptr + offs_n, mask=mask_n, other=0).to(tl.int32)
        acc = tl.zeros((BLOCK_N, BLOCK_O), dtype=tl.float32)
        for k in tl.static_range(BITS):
            sign = (_code_bits_of(ids, k, rows_ptr, shift, BITS, CANONICAL) * 2 - 1).to(tl.float32)
            f = tl.load(f_ptr + offs_o * BITS + k, mask=mask_o, other=0.0).to(tl.float32)
            acc += sign[:, None] * f[None, :]
        out = acc * alpha
        offs = offs_n[:, None].to(tl.int64) * n_out + offs_o[None, :]
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_o[None, :])

    @triton.jit
    def _add_code_kernel(ids_ptr, rows_ptr, y_ptr, out_ptr, n_tokens, width, shift, pos_val, neg_val,
                         BITS: tl.constexpr, CANONICAL: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_W: tl.constexpr):
        # out = y + code(ids): the residual add of the first block, generating the code in the
        # epilogue. pos_val/neg_val are +-scale already rounded to the activation dtype (as encode
        # rounds them), so fp32(y) + fp32(val) rounded once equals torch's dtype add of the two.
        pid_t = tl.program_id(0)
        pid_w = tl.program_id(1)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
        mask_t = offs_t < n_tokens
        mask_w = offs_w < width
        ids = tl.load(ids_ptr + offs_t, mask=mask_t, other=0).to(tl.int32)
        k = offs_w % BITS
        bit = code_bits_tile(ids, k, rows_ptr, mask_w, shift, CANONICAL)
        offs = offs_t[:, None].to(tl.int64) * width + offs_w[None, :]
        mask = mask_t[:, None] & mask_w[None, :]
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        val = tl.where(bit != 0, pos_val, neg_val)
        tl.store(out_ptr + offs, (y + val).to(out_ptr.dtype.element_ty), mask=mask)


_ADD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------- math in torch
@torch.compiler.assume_constant_result  # a Python float fixed by its arguments: no graph break under compile
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` as an fp32 tensor holds it, rounded to ``dtype`` (as ``encode`` rounds the code's scale)."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))


def code_value(code: FixedCode, dtype: torch.dtype) -> float:
    """``s``: the magnitude of the code's entries as the activation dtype holds them."""
    return abs(_rounded(code.scale, dtype))


def norm_alpha(code: FixedCode, eps: float, dtype: torch.dtype) -> float:
    """``rmsnorm(+-s vector) = alpha * sign * gamma`` with ``alpha = s / sqrt(s^2 + eps)``."""
    s = code_value(code, dtype)
    return s / math.sqrt(s * s + eps)


def fold(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """``[out, d] -> [out, bits]``: column ``k`` sums the input columns ``j`` with ``j % bits == k``.

    Differentiable torch ops, so the gradient into ``weight`` (and a gamma multiplied in before)
    is autograd's: ``dW[:, j] = dF[:, j % bits]``.
    """
    out_dim, d = weight.shape
    reps, rem = divmod(d, bits)
    folded = weight[:, : reps * bits].reshape(out_dim, reps, bits).sum(1)
    if rem:  # a partial last tile contributes to the first `rem` code bits only
        folded = torch.cat([folded[:, :rem] + weight[:, reps * bits:], folded[:, rem:]], dim=1)
    return folded


def code_signs(ids: torch.Tensor, code: FixedCode, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``C``: the bits-wide code as +-1 in ``dtype``, shape ``ids.shape + (bits,)``."""
    return (code.code_bits(ids) * 2 - 1).to(dtype)


def code_qkv_reference(ids: torch.Tensor, code: FixedCode, folded: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * C @ F.T`` in torch (fp32 accumulation): the CPU path and the kernel's reference."""
    c = code_signs(ids, code, torch.float32)
    return (alpha * (c @ folded.float().t())).to(folded.dtype)


# ----------------------------------------------------------------------------------- kernels
def _launch_guard(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def code_qkv_launch(ids: torch.Tensor, code: FixedCode, folded: torch.Tensor,
                    alpha: float) -> tuple[torch.Tensor, Optional[KernelLaunch]]:
    """(output, launch) of :func:`code_qkv_kernel`: allocation and arguments only (``None``: no tokens)."""
    n_out = folded.shape[0]
    out = torch.empty(*ids.shape, n_out, dtype=folded.dtype, device=ids.device)
    n = ids.numel()
    if n == 0:
        return out, None
    # 8 warps: with 4, the 64 x 128 fp32 accumulator and the unrolled bit loop spill ~25 KB per
    # thread on sm_90/sm_100 (ptxas -v; tests/test_kernel_compile.py); 8 warps fit in 80 registers.
    block_n, block_o, num_warps = 64, 128, 8
    grid = (triton.cdiv(n, block_n), triton.cdiv(n_out, block_o))
    return out, KernelLaunch(_code_qkv_kernel, grid,
                             (ids.reshape(-1).contiguous(), _rows_on(tuple(code.rows), ids.device),
                              folded.contiguous(), out, n, n_out, int(code.shift), float(alpha)),
                             dict(BITS=code.bits, CANONICAL=code.is_identity, BLOCK_N=block_n, BLOCK_O=block_o,
                                  num_warps=num_warps))


def code_qkv_kernel(ids: torch.Tensor, code: FixedCode, folded: torch.Tensor, alpha: float) -> torch.Tensor:
    """Triton forward of :func:`code_qkv_reference`: ``[*ids.shape, out]`` in ``folded.dtype``."""
    bits = folded.shape[1]
    assert bits == code.bits, f"folded weights have {bits} columns for a {code.bits}-bit code"
    out, launch = code_qkv_launch(ids, code, folded, alpha)
    if launch is not None:
        with _launch_guard(ids):
            launch()
    return out


def add_code_launch(y: torch.Tensor, ids: torch.Tensor, code: FixedCode,
                    code_dtype: torch.dtype) -> tuple[torch.Tensor, Optional[KernelLaunch]]:
    """(output, launch) of :func:`add_code_kernel`: allocation and arguments only (``None``: no tokens)."""
    width = y.shape[-1]
    out = torch.empty(y.shape, dtype=torch.promote_types(code_dtype, y.dtype), device=y.device)
    n = ids.numel()
    if n == 0:
        return out, None
    pos, neg = _rounded(code.scale, code_dtype), _rounded(-code.scale, code_dtype)
    block_w = min(512, triton.next_power_of_2(width))
    block_t = max(16, min(128, 8192 // block_w))
    grid = (triton.cdiv(n, block_t), triton.cdiv(width, block_w))
    return out, KernelLaunch(_add_code_kernel, grid,
                             (ids.reshape(-1).contiguous(), _rows_on(tuple(code.rows), ids.device), y.contiguous(),
                              out, n, width, int(code.shift), pos, neg),
                             dict(BITS=code.bits, CANONICAL=code.is_identity, BLOCK_T=block_t, BLOCK_W=block_w,
                                  num_warps=4))


def add_code_kernel(y: torch.Tensor, ids: torch.Tensor, code: FixedCode,
                    code_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Triton ``code.encode(ids, width, code_dtype) + y`` without materialising the code.

    The result has torch's promoted dtype of the two (as the unfused add does): the code's +-scale
    is rounded to ``code_dtype`` first, then added to ``y`` in fp32 and rounded once to the result.
    ``y`` must be ``ids.shape + (width,)``: the kernel indexes ``y`` by token, so any other shape
    would read and write out of bounds; it raises as the torch path's broadcast does.
    """
    if tuple(y.shape[:-1]) != tuple(ids.shape):
        raise ValueError(f"add_code: y has shape {tuple(y.shape)} but the ids {tuple(ids.shape)} need "
                         f"{tuple(ids.shape)} + (width,)")
    out, launch = add_code_launch(y, ids, code, code_dtype or y.dtype)
    if launch is not None:
        with _launch_guard(ids):
            launch()
    return out


class _CodeQKV(torch.autograd.Function):
    """Kernel forward; backward ``dF = alpha * dY.T @ C`` with the bits-wide code (never width-wide)."""

    @staticmethod
    def forward(ctx, ids, folded, code, alpha):
        ctx.save_for_backward(ids)
        ctx.code, ctx.alpha = code, alpha
        return code_qkv_kernel(ids, code, folded, alpha)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        c = code_signs(ids, ctx.code, torch.float32).reshape(-1, ctx.code.bits)
        d_folded = ctx.alpha * (grad.reshape(-1, grad.shape[-1]).float().t() @ c)
        return None, d_folded.to(grad.dtype), None, None


class _AddCode(torch.autograd.Function):
    """``y + code(ids)``: the code is a constant, so the gradient passes to ``y`` unchanged."""

    @staticmethod
    def forward(ctx, y, ids, code, code_dtype):
        ctx.y_dtype = y.dtype
        return add_code_kernel(y, ids, code, code_dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.y_dtype), None, None, None


# ----------------------------------------------------------------------------------- entry points
def code_qkv(ids: torch.Tensor, code: FixedCode, folded: torch.Tensor, alpha: float,
             force_kernel: bool = False) -> torch.Tensor:
    """``alpha * C @ folded.T`` from token ids; differentiable in ``folded``."""
    if _wants_kernel(ids, folded.dtype, force_kernel) and (ids.is_cuda or kernel_is_interpreted()):
        return _CodeQKV.apply(ids, folded, code, alpha)
    return code_qkv_reference(ids, code, folded, alpha)


def add_code(y: torch.Tensor, ids: torch.Tensor, code: FixedCode, force_kernel: bool = False,
             code_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The first residual add ``code(ids) + y``, bit-identical to ``code.encode(ids, d, code_dtype) + y``.

    ``code_dtype`` is the dtype the unfused input writes the code in (``FixedCodeInput.out_dtype``;
    default ``y.dtype``). Under autocast ``y`` (an attention output) is bf16 while the unfused
    model's code is fp32, so its residual stream is fp32 from block 0 on: the result here has the
    same promoted dtype, so the fused and unfused models carry the same residual precision.
    """
    code_dtype = code_dtype or y.dtype
    # The kernel adds in fp32: exact-then-rounded for 16- and 32-bit floats, not for fp64.
    if (y.dtype in _ADD_DTYPES and code_dtype in _ADD_DTYPES and _wants_kernel(ids, y.dtype, force_kernel)
            and (ids.is_cuda or kernel_is_interpreted())):
        return _AddCode.apply(y, ids, code, code_dtype)
    return code.encode(ids, y.shape[-1], dtype=code_dtype, validate=False) + y


def first_layer_qkv(ids: torch.Tensor, code: FixedCode, norm_weight: torch.Tensor, norm_eps: float,
                    weights: list, biases: list, force_kernel: bool = False, local=None) -> list:
    """``[q, k, v]`` of the first block, equal to ``w(rmsnorm(code(ids)))`` for each ``w``.

    One fused product for all three projections (their folded weights concatenated), split after.
    ``local`` (optional) maps each folded ``[out, bits]`` weight to the tensor the product reads:
    the model passes its tensor-parallel rows there (``megafixed.model.fused``), so that each weight
    is folded with its own sharding before the three are concatenated.
    """
    alpha = norm_alpha(code, norm_eps, weights[0].dtype)
    local = local or (lambda t: t)
    folded = torch.cat([local(fold(w * norm_weight[None, :].to(w.dtype), code.bits)) for w in weights], dim=0)
    out = code_qkv(ids, code, folded, alpha, force_kernel=force_kernel)
    parts = list(out.split([local(w).shape[0] for w in weights], dim=-1))
    return [p if b is None else p + b for p, b in zip(parts, biases)]


__all__ = ["fold", "norm_alpha", "code_value", "code_signs", "code_qkv", "code_qkv_reference", "code_qkv_kernel",
           "add_code", "add_code_kernel", "first_layer_qkv"]
