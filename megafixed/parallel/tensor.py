"""Tensor (and sequence) parallelism on the plain GPT, torchtitan-style: ``apply_tp(model, cfg)``.

The layers are megatron-core's (``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``, ``vocab_parallel_cross_entropy``): they carry the communication and
mark their sharded parameters ``tensor_model_parallel=True``, which is what DeepSpeed's gradient
norm reads to count each parameter once. We do not use megatron's GPTModel (CUDA-only paths) and
keep our own model: ``apply_tp`` swaps the Linear modules named in ``model.gpt.TP_PLAN`` in place and
copies the matching slice of the full, already-initialised weight into each shard, so a TP run
starts from exactly the single-process weights (and parameter names do not change, which keeps
checkpoints convertible).

Layout conventions: our activations are batch-first ``[B, T, D]``; megatron's sequence-parallel
collectives act on dim 0 (sequence-first). The thin subclasses below transpose at the boundary
only when sequence parallelism is on.

* Fixed codes need no TP communication at the input: every rank computes the codes itself (under
  sequence parallelism only for its own slice of positions).
* The learned table is a ``VocabParallelEmbedding`` (vocabulary rows split, partial lookups
  all-reduced, or reduce-scattered over the sequence under SP).
* The output head is column-parallel over the vocabulary with ``gather_output=False`` and the loss
  is ``vocab_parallel_cross_entropy``: the full ``[B, T, V]`` logits never exist on one rank.
  ``gather_logits`` assembles them explicitly for evaluation or generation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..model.gpt import GPT, TP_PLAN, apply_rope
from ..model.inputs import FixedCodeInput, LearnedInput
from .sequence import gather_last_dim, gather_sequence, reduce_scatter_sequence


def megatron_config(cfg, dtype: torch.dtype = torch.float32):
    """megatron-core's ModelParallelConfig for our layers (CPU-safe: no fused CUDA paths).

    ``sequence_parallel`` stays False here on purpose: megatron's sequence-parallel code paths
    allocate on CUDA, so our subclasses do the sequence collectives themselves (``sequence.py``).
    """
    from megatron.core import ModelParallelConfig

    return ModelParallelConfig(tensor_model_parallel_size=cfg.parallel.tp,
                               sequence_parallel=False,
                               use_cpu_initialization=True,  # shards are filled from the full model
                               perform_initialization=False,
                               gradient_accumulation_fusion=False,
                               params_dtype=dtype)


def _no_init(_weight):  # weights are copied from the full model, never drawn here
    return None


def _mark_sharded(param: nn.Parameter, dim: int) -> None:
    if not hasattr(param, "tensor_model_parallel"):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        set_tensor_model_parallel_attributes(param, True, dim, 1)


def _build_column(base, seq_group):
    class ColumnParallel(base):
        """Column-parallel Linear on batch-first input, returning only the output.

        Without SP: megatron's forward (identity forward, all-reduce of the input grad).
        With SP: all-gather the sequence shards, then the local matmul (the gather's backward
        reduce-scatters the input grad, replacing megatron's all-reduce).
        """

        def forward(self, x):  # noqa: D401
            if seq_group is not None:
                return F.linear(gather_sequence(x, seq_group), self.weight, self.bias)
            out, _ = super().forward(x)
            return out
    return ColumnParallel


def _build_row(base, seq_group):
    class RowParallel(base):
        """Row-parallel Linear, batch-first: partial products summed across TP (all-reduce), or
        under SP reduce-scattered so each rank keeps its T/tp positions; bias added after."""

        def forward(self, x):
            if seq_group is not None:
                out = reduce_scatter_sequence(F.linear(x, self.weight), seq_group)
                return out + self.bias if self.bias is not None else out
            out, _ = super().forward(x)
            return out
    return RowParallel


def _build_embedding(base, seq_group):
    class VocabParallelTable(base):
        """Vocab-parallel lookup: each rank looks up the ids in its row range, zeros the rest,
        and the partial results are summed across TP (all-reduce; reduce-scatter over the
        sequence under SP, leaving ``[B, T/tp, D]``)."""

        def forward(self, ids):
            if seq_group is None:
                return super().forward(ids)
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local = (ids - self.vocab_start_index).masked_fill(outside, 0)
            partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
            return reduce_scatter_sequence(partial, seq_group)
    return VocabParallelTable


class TensorParallelAttention(nn.Module):
    """The model's attention with local heads; the sequence length comes from the projections,
    so it is right both with and without sequence parallelism (where ``x`` holds T/tp positions
    but q/k/v hold all T after the column-parallel all-gather)."""

    def __init__(self, wq, wk, wv, wo, head_dim: int, group: int, dropout: float):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.head_dim, self.group, self.dropout = head_dim, group, dropout

    def forward(self, x, cos, sin):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        B, T = q.shape[:2]
        q = apply_rope(q.view(B, T, -1, self.head_dim), cos[:T], sin[:T])
        k = apply_rope(k.view(B, T, -1, self.head_dim), cos[:T], sin[:T])
        v = v.view(B, T, -1, self.head_dim)
        if self.group > 1:
            k = k.repeat_interleave(self.group, dim=2)
            v = v.repeat_interleave(self.group, dim=2)
        y = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            dropout_p=self.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SequenceShardCodeInput(FixedCodeInput):
    """Fixed codes for this rank's slice of positions only (sequence parallelism): no table, no
    communication; each rank derives its own ``[B, T/tp, D]`` codes from the token ids."""

    def __init__(self, original: FixedCodeInput, tp: int, tp_rank: int):
        super().__init__(original.code, original.d_model)
        self.out_dtype = original.out_dtype
        self.tp, self.tp_rank = tp, tp_rank

    def forward(self, ids):
        T = ids.shape[1]
        local = T // self.tp
        return super().forward(ids[:, self.tp_rank * local:(self.tp_rank + 1) * local])


class VocabParallelInput(LearnedInput):
    """The learned table split by vocabulary rows; same parameter name (and type test) as
    ``LearnedInput``, whose own full-size table it never allocates."""

    def __init__(self, embedding: nn.Module):
        nn.Module.__init__(self)
        self.embedding = embedding

    def forward(self, ids):
        return self.embedding(ids)


def vocab_parallel_loss(local_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss from vocabulary-sharded logits (no rank ever holds all of V)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(local_logits.float(), targets).mean()


def gather_logits(local_logits: torch.Tensor) -> torch.Tensor:
    """Full ``[..., V]`` logits from the vocabulary shards (for evaluation and generation)."""
    from megatron.core import parallel_state

    return gather_last_dim(local_logits, parallel_state.get_tensor_model_parallel_group())


def _shard(full: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    return full.chunk(tp, dim=dim)[rank].clone()


def _column(linear: nn.Linear, mcfg, tp: int, rank: int, cls) -> nn.Module:
    layer = cls(linear.in_features, linear.out_features, config=mcfg, init_method=_no_init,
                bias=linear.bias is not None, gather_output=False)
    with torch.no_grad():
        layer.weight.copy_(_shard(linear.weight, 0, tp, rank))
        if linear.bias is not None:
            layer.bias.copy_(_shard(linear.bias, 0, tp, rank))
    _mark_sharded(layer.weight, 0)
    return layer


def _row(linear: nn.Linear, mcfg, tp: int, rank: int, cls) -> nn.Module:
    layer = cls(linear.in_features, linear.out_features, config=mcfg, init_method=_no_init,
                bias=linear.bias is not None, input_is_parallel=True, skip_bias_add=False)
    with torch.no_grad():
        layer.weight.copy_(_shard(linear.weight, 1, tp, rank))
        if linear.bias is not None:
            layer.bias.copy_(linear.bias)
    _mark_sharded(layer.weight, 1)
    return layer


def _allreduce_over_tp_hook(group):
    import torch.distributed as dist

    def hook(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad
    return hook


def apply_tp(model: GPT, cfg, tp_rank: int | None = None) -> GPT:
    """Shard ``model`` (a full, initialised GPT, identical on every TP rank) in place for this rank.

    Needs megatron-core's parallel_state initialised (``setup_distributed`` does it).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                               VocabParallelEmbedding)

    tp = cfg.parallel.tp
    rank = parallel_state.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    sp = cfg.parallel.sequence_parallel
    mcfg = megatron_config(cfg, dtype=model.head.proj.weight.dtype)
    group = parallel_state.get_tensor_model_parallel_group()
    seq_group = group if sp else None
    Column, Row = _build_column(ColumnParallelLinear, seq_group), _build_row(RowParallelLinear, seq_group)

    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        new = {}
        for name, kind in TP_PLAN.items():
            owner_name, attr = name.split(".")
            owner = attn if owner_name == "attn" else mlp
            linear = getattr(owner, attr, None)
            if linear is None:  # w_gate only exists for SwiGLU
                continue
            new[name] = (_column(linear, mcfg, tp, rank, Column) if kind == "column"
                         else _row(linear, mcfg, tp, rank, Row))
        block.attn = TensorParallelAttention(new["attn.wq"], new["attn.wk"], new["attn.wv"],
                                             new["attn.wo"], attn.head_dim, attn.group, attn.dropout)
        for name in ("mlp.w_in", "mlp.w_gate", "mlp.w_out"):
            if name in new:
                setattr(mlp, name.split(".")[1], new[name])

    # Output head: vocabulary rows split, logits stay sharded, loss is vocab-parallel.
    model.head.proj = _column(model.head.proj, mcfg, tp, rank, Column)
    if model.has_learned_input:
        Table = _build_embedding(VocabParallelEmbedding, seq_group)
        table = Table(model.cfg.vocab_size, model.cfg.d_model, init_method=_no_init, config=mcfg)
        with torch.no_grad():
            table.weight.copy_(_shard(model.input.embedding.weight, 0, tp, rank))
        _mark_sharded(table.weight, 0)
        model.input = VocabParallelInput(table)
        if model.cfg.tie_embeddings:
            model.head.proj.weight = table.weight
    elif sp:
        model.input = SequenceShardCodeInput(model.input, tp, rank)
    model.loss = vocab_parallel_loss  # instance attribute shadows the static GPT.loss

    if sp:
        # Norms (and row-parallel biases) now see only T/tp positions: their gradients are
        # partial sums over the sequence and must be summed across the TP group (Megatron's
        # `sequence_parallel` parameter attribute, reduced in its finalize_model_grads).
        for name, p in model.named_parameters():
            if getattr(p, "tensor_model_parallel", False):
                continue
            if name.startswith("input."):
                continue
            p.sequence_parallel = True
            p.register_hook(_allreduce_over_tp_hook(group))
    model.tensor_parallel = tp
    return model


def sharded_dim(name: str) -> int | None:
    """Which dim of the plain-GPT parameter ``name`` is split under TP (None: replicated)."""
    if name.endswith("input.embedding.weight") or name.endswith("head.proj.weight"):
        return 0
    for key, kind in TP_PLAN.items():
        if name.endswith(f"{key}.weight"):
            return 0 if kind == "column" else 1
        if name.endswith(f"{key}.bias"):
            return 0 if kind == "column" else None
    return None
