"""Tensor and sequence parallelism for the torch engine: DTensor ``parallelize_module`` of the plain GPT.

The second applier of the one TP plan (``megafixed.parallel.tensor.linear_plan``: which Linear is
column-, which row-parallel). The DeepSpeed engine swaps those Linears for megatron-core layers;
this one keeps every module and parameter name and turns the parameters into DTensors on the TP
mesh (torchtitan's way), so the model never learns about parallelism and FSDP2, DCP and
``clip_grad_norm_`` see ordinary DTensors:

* column Linears -> ``ColwiseParallel`` (output features split; local outputs, so Attention's
  ``view(B, T, -1, head_dim)`` sees ``heads/tp`` heads and ``kv_heads/tp`` key/value heads: the
  layout rules require both to divide), row Linears -> ``RowwiseParallel`` (partial products
  all-reduced, or reduce-scattered over the sequence under SP);
* the output head: ``ColwiseParallel`` over the vocabulary with ``Shard(-1)`` DTensor logits, and
  the model's loss seam (``model.loss_fn``) becomes the cross entropy that ``loss_parallel()``
  computes without gathering the ``[B, T, V]`` logits (``loss_context`` wraps forward+backward);
* the input takes its interface's TP form (``megafixed.model.interfaces``): a learned table
  (``VOCAB_PARALLEL``) is ``RowwiseParallel`` (vocabulary rows split, masked lookups summed; under
  SP reduce-scattered to ``Shard(1)``); a fixed code (``REPLICATED``) needs no communication at
  all: every rank computes it, under SP only for its own ``T/tp`` positions;
* ``PrepareModuleInput`` before attention and the MLP: one all-gather of the sequence shards
  under SP, and in both cases one input-gradient reduction per module, not one per Linear;
* the norms: ``SequenceParallel`` under SP (``[B, T/tp, D]`` activations); without SP replicated DTensors
  (``ReplicateParallel``), so that *every* parameter is a DTensor on the TP mesh and a gradient
  norm over them counts each parameter once (a mix of plain tensors and DTensors is what
  ``clip_grad_norm_`` cannot stack).

Materialisation is not done here: ``apply_tp`` runs on the meta-device model and the engine gives
every DTensor its local shard of the single-process initial value afterwards.
"""
from __future__ import annotations

import contextlib

import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor import parallel as tp
from torch.distributed.tensor.parallel.style import ParallelStyle

from ...model.interfaces import VOCAB_PARALLEL
from ...parallel.tensor import keep_local_positions, linear_plan

_STYLES = {"column": tp.ColwiseParallel, "row": tp.RowwiseParallel}
# Attention is called as attn(x, cos, sin, cache) by Block.forward: only x is an activation.
_ATTENTION_ARGS = 4


class ReplicateParallel(ParallelStyle):
    """A module whose parameters are replicated over the TP mesh and whose input and output are
    full (replicated) plain tensors: the norms without sequence parallelism.

    Numerically the plain module; what changes is that its parameters are DTensors like all the
    others, so the gradient norm, FSDP2's 2-D sharding and DCP treat the model uniformly. Its
    gradient needs no reduction: the input is the same on every rank, and the gradient arriving
    from the column-parallel layers after it is already summed over TP (ColwiseParallel's input
    conversion all-reduces it)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_module, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                         if not isinstance(x, DTensor) else x for x in inputs)

        def to_local(_module, output, _mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        # partition_fn=None: distribute_module replicates every parameter
        return distribute_module(module, device_mesh, None, input_fn=to_dtensor, output_fn=to_local)


def vocab_parallel_loss(logits, targets):
    """Mean next-token loss from ``Shard(-1)`` (vocabulary-split) DTensor logits.

    Under ``loss_parallel()`` (``loss_context``) the softmax and the target pick run on each rank's
    vocabulary slice with two small all-reduces; outside it DTensor would gather the logits first
    (same value, full memory). Returns a plain tensor (the same on every TP rank), like the
    single-process loss, so the engine averages, logs and back-propagates it as usual.

    The DeepSpeed engine's twin (``megafixed.engine.deepspeed.tp_layers.vocab_parallel_loss``) computes the same
    float32 loss with megatron-core's ``vocab_parallel_cross_entropy``, which takes plain local logits
    and its own TP group; this one takes DTensor placements and torch's collectives. Each accepts only
    its own stack's logits, so beyond ``.float()`` and the mean there is no common body to share."""
    loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
    return loss.to_local() if isinstance(loss, DTensor) else loss


def _norm_style(sequence_parallel: bool) -> ParallelStyle:
    return tp.SequenceParallel() if sequence_parallel else ReplicateParallel()


def _block_plan(model, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {}
    for path, kind in linear_plan(model).items():
        if kind == "row":
            # row outputs: summed over TP (all-reduce) or each rank keeps T/tp positions (reduce-scatter)
            plan[path] = tp.RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())
        elif path.startswith("head."):
            # vocabulary-parallel head: logits stay split over V for the loss
            plan[path] = tp.ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                                         output_layouts=Shard(-1), use_local_output=False)
        else:
            plan[path] = _STYLES[kind]()
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.norm1"] = _norm_style(sequence_parallel)
        plan[f"blocks.{i}.norm2"] = _norm_style(sequence_parallel)
        # The activations enter attention and the MLP as ONE replicated DTensor that every
        # column Linear there reads (q/k/v; w_in/w_gate), so their input gradients add up as
        # DTensor partial sums and are reduced once per module: under SP one all-gather forward
        # and one reduce-scatter backward of the T/tp shards, without SP one all-reduce backward
        # (Megatron's f/g). Converting in each Linear instead would reduce once per Linear.
        before = Shard(1) if sequence_parallel else Replicate()
        plan[f"blocks.{i}.attn"] = tp.PrepareModuleInput(
            input_layouts=(before, *[None] * (_ATTENTION_ARGS - 1)),
            desired_input_layouts=(Replicate(), *[None] * (_ATTENTION_ARGS - 1)))
        plan[f"blocks.{i}.mlp"] = tp.PrepareModuleInput(input_layouts=(before,), desired_input_layouts=(Replicate(),))
    plan["head.norm"] = _norm_style(sequence_parallel)
    return plan


def apply_tp(model, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Tensor- (and, with ``sequence_parallel``, sequence-) parallelise ``model`` over ``tp_mesh``, in place.

    ``model`` is the plain GPT, normally on the meta device. No communication happens here
    (``src_data_rank=None``: each rank keeps its own slice of whatever values it has), so a model
    built from the same seed on every rank is split exactly, and a meta model is materialised
    afterwards shard by shard. Parameter names do not change."""
    interface = model.interface
    plan = _block_plan(model, sequence_parallel)
    if interface.tp_form == VOCAB_PARALLEL:
        table = "input." + interface.table.rpartition(".")[0]  # "embedding.weight" -> the module
        plan[table] = tp.RowwiseParallel(input_layouts=Replicate(),
                                      output_layouts=Shard(1) if sequence_parallel else Replicate())
    elif sequence_parallel:
        # a fixed code is computed, not looked up: each rank makes only its own positions
        keep_local_positions(model.input, tp_mesh.size(), tp_mesh.get_local_rank())
    tp.parallelize_module(model, tp_mesh, plan, src_data_rank=None)
    if model.cfg.tie_embeddings:
        # parallelize_module gives each module its own DTensor; the table's Shard(0) over the
        # vocabulary is exactly the head's, so one parameter serves both again.
        model.head.proj.weight = model.input.get_parameter(interface.table)
    model.loss_fn = vocab_parallel_loss  # the model's loss seam


def is_vocab_parallel(model) -> bool:
    """Whether ``model``'s loss takes vocabulary-split logits (``apply_tp`` ran on it)."""
    return getattr(model, "loss_fn", None) is vocab_parallel_loss


@contextlib.contextmanager
def loss_context(model):
    """The context a forward+backward (or an evaluation forward) of ``model`` runs in:
    ``loss_parallel()`` for a tensor-parallel model, nothing otherwise.

    torch's ``loss_parallel`` switches its ops off after its ``yield`` without a ``finally``, so an
    exception inside a plain ``with`` would leave them on: here they are switched off either way."""
    if not is_vocab_parallel(model):
        yield
        return
    manager = tp.loss_parallel()
    manager.__enter__()
    try:
        yield
    finally:
        manager.__exit__(None, None, None)  # resumes it past its yield: the ops are switched off
