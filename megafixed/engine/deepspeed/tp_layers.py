"""Tensor (and sequence) parallelism on the plain GPT, torchtitan-style: ``apply_tp(model, topo)``,
the DeepSpeed engine's (moved
from ``megafixed/parallel/tensor.py``, which keeps the engine-neutral TP plan: megatron-core is
imported only under ``megafixed/engine/``).

The layers are megatron-core's (``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``, ``vocab_parallel_cross_entropy``): they carry the communication and
mark their sharded parameters ``tensor_model_parallel=True``, which is what DeepSpeed's gradient
norm reads to count each parameter once. They come through ``megatron_tp.load()``, which imports
them without the rest of megatron-core (its ``__init__`` costs seconds per rank). We do not use
megatron's GPTModel (CUDA-only paths) and keep our own model: ``apply_tp`` swaps the Linear modules
named in ``TP_PLAN`` in place on a model built on the meta device;
``megafixed.engine.deepspeed.model.build_model`` then materialises each rank's shards with the
matching slice of the single-process initial values (``sharded_dim`` says which), so a TP run
starts from exactly the single-process weights without any rank holding the full model.
Parameter names do not change, which keeps checkpoints convertible.

Layout conventions: our activations are batch-first ``[B, T, D]``; megatron's sequence-parallel
collectives act on dim 0 (sequence-first). The thin subclasses below transpose at the boundary
only when sequence parallelism is on.

The input takes the TP form its interface names (``megafixed.model.interfaces``):

* ``REPLICATED`` (fixed codes) needs no TP communication at the input: every rank computes the
  codes itself (under sequence parallelism only for its own slice of positions).
* ``VOCAB_PARALLEL`` (the learned table) becomes a ``VocabParallelEmbedding`` (vocabulary rows
  split, partial lookups all-reduced, or reduce-scattered over the sequence under SP).
* The output head is column-parallel over the vocabulary with ``gather_output=False`` and the loss
  is ``vocab_parallel_cross_entropy``: the full ``[B, T, V]`` logits never exist on one rank.
  Evaluation and generation gather a checkpoint into a plain model instead
  (``megafixed.train.evaluate.load_trained_model``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: F401
from torch import nn

from ...model.gpt import GPT
from ...model.interfaces import VOCAB_PARALLEL, sharded_parameters, vocab_parameters  # noqa: F401
from ...parallel.sequence import gather_sequence, reduce_scatter_sequence  # noqa: F401
from ...parallel.tensor import HEAD_PLAN, TP_PLAN, keep_local_positions, linear_plan, sharded_dim  # noqa: F401


def megatron_config(tp: int, dtype: torch.dtype = torch.float32):
    """megatron-core's ModelParallelConfig for our layers (CPU-safe: no fused CUDA paths).

    ``sequence_parallel`` stays False here on purpose: megatron's sequence-parallel code paths
    allocate on CUDA, so our subclasses do the sequence collectives themselves (``sequence.py``).
    """
    from .megatron_tp import load

    return load().ModelParallelConfig(tensor_model_parallel_size=tp,
                               sequence_parallel=False,
                               # no CUDA allocation at construction: layers are built on the meta
                               # device and filled by build_model with the single-process values
                               use_cpu_initialization=True,
                               perform_initialization=False,
                               gradient_accumulation_fusion=False,
                               params_dtype=dtype)


def _no_init(_weight):  # values come from build_model's per-parameter init, never drawn here
    return None


def _mark_sharded(param: nn.Parameter, dim: int) -> None:
    if not hasattr(param, "tensor_model_parallel"):
        from .megatron_tp import load
        load().layers.set_tensor_model_parallel_attributes(param, True, dim, 1)


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


def vocab_parallel_loss(local_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss from vocabulary-sharded logits (no rank ever holds all of V)."""
    from .megatron_tp import load

    return load().cross_entropy.vocab_parallel_cross_entropy(local_logits.float(), targets).mean()


def _column(linear: nn.Linear, mcfg, cls) -> nn.Module:
    layer = cls(linear.in_features, linear.out_features, config=mcfg, init_method=_no_init,
                bias=linear.bias is not None, gather_output=False)
    _mark_sharded(layer.weight, 0)
    return layer


def _row(linear: nn.Linear, mcfg, cls) -> nn.Module:
    layer = cls(linear.in_features, linear.out_features, config=mcfg, init_method=_no_init,
                bias=linear.bias is not None, input_is_parallel=True, skip_bias_add=False)
    _mark_sharded(layer.weight, 1)
    return layer


def apply_tp(model: GPT, topo) -> GPT:
    """Swap ``model``'s layers for tensor-parallel ones for this rank (``topo.tp_rank``), in place.

    ``model`` is normally on the meta device (``build_model`` materialises and initialises the
    shards afterwards). Needs megatron-core's parallel_state initialised (``setup_distributed``).
    Sequence-parallel parameters (norms and row-parallel biases, which see only T/tp positions)
    are marked ``sequence_parallel=True``; ``megafixed.engine.deepspeed.grads`` sums their gradients over
    the TP group once per step.
    """
    from .megatron_tp import load

    layers = load().layers  # megatron-core's TP layers without the rest of it (megatron_tp.py)
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding = (
        layers.ColumnParallelLinear, layers.RowParallelLinear, layers.VocabParallelEmbedding)

    tp, rank = topo.tp, topo.tp_rank
    mcfg = megatron_config(tp, dtype=model.head.proj.weight.dtype)
    seq_group = topo.tp_group if topo.sequence_parallel else None
    Column, Row = _build_column(ColumnParallelLinear, seq_group), _build_row(RowParallelLinear, seq_group)

    # The blocks' Linears and the output head (vocabulary rows split, logits stay sharded, loss
    # vocab-parallel), from the shared plan.
    for path, kind in linear_plan(model).items():
        owner, _, attr = path.rpartition(".")
        parent = model.get_submodule(owner)
        linear = getattr(parent, attr)
        setattr(parent, attr, _column(linear, mcfg, Column) if kind == "column" else _row(linear, mcfg, Row))
    interface = model.interface
    if interface.tp_form == VOCAB_PARALLEL:
        # The interface's own table (an nn.Embedding at interface.table) is swapped for a
        # vocabulary-parallel one; the input module around it, and every name, stay.
        Table = _build_embedding(VocabParallelEmbedding, seq_group)
        table = Table(model.cfg.vocab_size, model.cfg.d_model, init_method=_no_init, config=mcfg)
        _mark_sharded(table.weight, 0)
        parent, _, attr = interface.table.rsplit(".", 1)[0].rpartition(".")  # "embedding.weight" -> "", "embedding"
        setattr(model.input.get_submodule(parent), attr, table)
        if model.cfg.tie_embeddings:
            model.head.proj.weight = table.weight
    elif topo.sequence_parallel:
        keep_local_positions(model.input, tp, rank)
    model.loss_fn = vocab_parallel_loss  # the model's loss seam

    if topo.sequence_parallel:
        for name, p in model.named_parameters():
            if not getattr(p, "tensor_model_parallel", False) and not name.startswith("input."):
                p.sequence_parallel = True
    return model
