"""``model.fused_first_layer=true``: the first block computed from token ids, never writing the code.

The first block of a fixed-code model normally reads ``x0 = code(ids)`` (``[B, T, d]``, written
by the input and read twice: by the norm and by the residual add). With the tiling, the normed
QKV projection is a rank-``bits`` product from the ids and the residual add can generate the code
itself (``megafixed.kernels.fused_first_layer`` has the algebra and the Triton kernels). The
parameters are the same modules under the same names (``blocks.0.norm1.weight``,
``blocks.0.attn.wq.weight``, ...), so fused and unfused models load each other's checkpoints:
the switch is an execution choice, not a different model.
"""
from __future__ import annotations

import torch


def fused_first_block(block, code, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      code_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``block(code(ids), cos, sin)`` for an RMSNorm block, through the folded weights.

    ``code_dtype``: the dtype the unfused input would write the code in (``FixedCodeInput.out_dtype``),
    so that the residual stream after this block has the unfused model's dtype (fp32 under autocast)."""
    from ..kernels.fused_first_layer import add_code, first_layer_qkv

    attn = block.attn
    linears = (attn.wq, attn.wk, attn.wv)
    qkv = first_layer_qkv(ids, code, block.norm1.weight, block.norm1.eps, [m.weight for m in linears],
                          [m.bias for m in linears])
    y = block.drop(attn(None, cos, sin, qkv=qkv))
    # the first residual add: x0 = code(ids) made in the add's epilogue
    x = add_code(y, ids, code, code_dtype=code_dtype)
    return x + block.drop(block.mlp(block.norm2(x)))
