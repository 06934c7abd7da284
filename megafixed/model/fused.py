"""``model.fused_first_layer=true``: the first block computed from token ids, never writing the code.

The first block of a fixed-code model normally reads ``x0 = code(ids)`` (``[B, T, d]``, written
by the input and read twice: by the norm and by the residual add). With the tiling, the normed
QKV projection is a rank-``bits`` product from the ids and the residual add can generate the code
itself (``megafixed.kernels.fused_first_layer`` has the algebra and the Triton kernels). The
parameters are the same modules under the same names (``blocks.0.norm1.weight``,
``blocks.0.attn.wq.weight``, ...), so fused and unfused models load each other's checkpoints:
the switch is an execution choice, not a different model.

It runs inside ``Block.forward`` of block 0, so it reads exactly the parameters that block's own
forward would: under FSDP2 the ones its pre-forward all-gather has just unsharded (no second full
copy is kept anywhere), under activation checkpointing and ``torch.compile`` the same wrapping as
every other block.
"""
from __future__ import annotations

from typing import Optional

import torch


def _local(t):
    """A parameter as this rank computes with it. Under tensor parallelism (DTensors on the TP mesh,
    ``megafixed.engine.native.tensor``) a q/k/v weight, bias or folded weight is column-parallel:
    its local tensor is this rank's output rows (its heads), which is all the product needs."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def fused_first_block(block, code_input, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``block(code_input(ids), cos, sin, attn_mask=attn_mask)`` for an RMSNorm block, through the folded weights.

    ``code_input``: the model's ``FixedCodeInput`` (its code, and the dtype it would write the code
    in, so that the residual stream after this block has the unfused model's dtype).

    Under TP the fold runs on DTensors (``W * gamma`` keeps W's row split, and DTensor gives the
    replicated norm weight its gradient summed over the TP ranks, as for the unfused norm) and the
    product on each rank's rows; the attention after it is the unfused one from its projections on.
    Under sequence parallelism the q/k/v product covers all T positions from the (replicated) ids,
    where the unfused block all-gathers the normed input first, and the residual add keeps this
    rank's T/tp positions: the input module's own position split applies (``code_input(ids, y)``)."""
    from ..kernels.fused_first_layer import first_layer_qkv

    attn = block.attn
    linears = (attn.wq, attn.wk, attn.wv)
    q, k, v = first_layer_qkv(ids, code_input.code, block.norm1.weight, block.norm1.eps, [m.weight for m in linears],
                              [None if m.bias is None else _local(m.bias) for m in linears], local=_local)
    y = block.drop(attn.attend(q, k, v, cos, sin, attn_mask=attn_mask))
    x = code_input(ids, y)  # the first residual add: x0 = code(ids) made in the add's epilogue
    return x + block.drop(block.mlp(block.norm2(x)))
