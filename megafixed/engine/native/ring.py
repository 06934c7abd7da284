"""Ring attention for the torch engine on CUDA (``parallel.cp_method=ring``): torch's ``context_parallel``
around one micro batch's forward and backward.

What torch does (``torch.distributed.tensor.experimental.context_parallel``; ``_context_parallel/`` in
torch 2.13), for the duration of the ``with``:

* it shards the buffers it is given along their sequence dimension over the 1-D ``cp`` mesh, in place,
  after reordering them with its causal load balancer (``_HeadTailLoadBalancer``) when the sequence
  splits into ``2 * cp`` equal chunks: rank ``r`` holds chunks ``r`` and ``2cp - 1 - r``, so every rank
  does the same share of the causal mask's work. Otherwise it shards contiguously and balances nothing
  (correct, but rank ``cp - 1`` then does the most work);
* it replaces ``F.scaled_dot_product_attention`` by a wrapper that makes q, k and v DTensors sharded on
  the sequence dimension of ``[B, heads, T, hd]``; DTensor sends the flash, memory-efficient and cuDNN
  kernels (and their backward) to ring implementations: each rank's queries meet every rank's keys and
  values (all-gathered once, torch's default rotation), the partial outputs merged by their log-sum-exp,
  and the backward sends the key/value gradients back round the ring. The math kernel (CPU) has no ring
  form ("CP only supports flash attention and memory efficient attention now"): ``RunPlan.build`` refuses
  ``ring`` off CUDA. The ring needs plain causal attention (``is_causal``, no mask), which is what
  ``GPT.forward`` runs without ``attn_mask`` (training and validation);
* on exit SDPA is itself again.

What this module adds (``ring_context``): the buffers it hands torch are its own copies, so that nothing
the caller holds changes shape: the inputs and labels (``split_tokens`` hands two overlapping views of
one tensor, which torch's in-place sharding would write across), the positions ``0..T-1``, and the first
``T`` rows of every RoPE table (``Rotary``; torchtitan hands its ``freqs_cis`` the same way), all in ONE
call, so all four follow the same order by construction. Each ``Rotary`` serves its rank's rows for the
context's duration (``Rotary.offset`` must stay 0: ring does not go through ``shard_model``). The loss
each rank computes is the mean over its ``T / cp`` tokens; the shards are equal, so the mean over the cp
ranks is the sequence's mean, and the gradients FSDP2 reduces over ``dp_shard_cp`` are one process's.

The engine's one entry is ``batch_context(topo)``: each micro batch's forward and backward (the step's,
validation's, a pipeline schedule's) run in ``batch_context(topo)(model, inputs, labels)`` on whole
sequences; it is ``ring_context`` over ``topo.mesh["cp"]`` under ring and the batch as it is otherwise.
Not covered anywhere yet: ring under ``train.compile`` (torch's SDPA wrapper inside Dynamo-traced blocks).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, ContextManager, Iterator, NamedTuple, Optional

import torch
from torch import nn


class RingShard(NamedTuple):
    """This rank's part of a micro batch under ring attention: ``[B, T/cp]`` each, in the same order."""
    inputs: torch.Tensor
    labels: torch.Tensor
    positions: Optional[torch.Tensor]  # each one's global position in its sequence (None: whole sequences)


def rotaries(model: nn.Module) -> list:
    """Every distinct ``Rotary`` of ``model`` (a ``GPT``, or a pipeline stage's parts)."""
    from ...model.gpt import Rotary

    seen: dict[int, nn.Module] = {}
    for m in model.modules():
        if isinstance(m, Rotary):
            seen.setdefault(id(m), m)
    return list(seen.values())


@contextmanager
def ring_context(mesh, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> Iterator[RingShard]:
    """Ring attention over the 1-D context-parallel ``mesh`` (the torch engine's ``mesh["cp"]``) for one
    micro batch of whole sequences, ``inputs`` and ``labels`` ``[B, T]``: yields this rank's ``RingShard``.
    Its forward AND backward must both run inside (the backward's attention is a ring too)::

        with ring_context(mesh["cp"], model, inputs, labels) as shard:
            loss = model(shard.inputs, shard.labels)   # the mean over this rank's T/cp tokens
            loss.backward()
    """
    from torch.distributed.tensor.experimental import context_parallel

    if mesh.ndim != 1:
        raise ValueError(f"ring attention runs over a 1-D context-parallel mesh, not {mesh.ndim}-D")
    T = inputs.shape[1]
    if labels.shape != inputs.shape or T % mesh.size():
        raise ValueError(f"inputs {tuple(inputs.shape)} and labels {tuple(labels.shape)} must be the same [B, T] "
                         f"whole sequences, T divisible by cp={mesh.size()}")
    device = inputs.device
    inputs, labels = inputs.clone(memory_format=torch.contiguous_format), labels.clone(
        memory_format=torch.contiguous_format)
    positions = torch.arange(T, device=device).expand(inputs.shape[0], T).contiguous()
    rots = rotaries(model)
    tables = []
    for rot in rots:
        if rot.offset:
            raise RuntimeError("a Rotary with an offset under ring attention: shard_model (Ulysses' contiguous "
                               "slices) was applied too; ring shards positions itself")
        cos, sin = rot.table(device)
        if cos.shape[0] < T:
            raise ValueError(f"sequences of {T} positions exceed the RoPE tables' {cos.shape[0]} (model.max_seq_len)")
        tables += [cos[:T].clone(), sin[:T].clone()]
    buffers = [inputs, labels, positions, *tables]
    dims = [1, 1, 1] + [0] * len(tables)
    saved = [(rot, dict(rot.tables)) for rot in rots]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=dims, no_restore_buffers=set(buffers)):
        try:
            for i, rot in enumerate(rots):  # this rank's rows, in its order, where Rotary.forward slices from 0
                rot.tables[str(device)] = (tables[2 * i], tables[2 * i + 1])
            yield RingShard(inputs, labels, positions)
        finally:
            for rot, before in saved:
                rot.tables.clear()
                rot.tables.update(before)


# (model, inputs, labels) -> the context one micro batch's forward (and backward) runs in, yielding its RingShard
BatchContext = Callable[[nn.Module, torch.Tensor, torch.Tensor], ContextManager[RingShard]]


@contextmanager
def whole_batch(_model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> Iterator[RingShard]:
    """The micro batch as it is (no ring): a step's ``batch_context`` default."""
    yield RingShard(inputs, labels, None)


def batch_context(topo) -> BatchContext:
    """The torch engine's one entry to ring attention: what each micro batch's forward and backward run in.
    ``ring_context`` over ``topo.mesh["cp"]`` when the run is ``parallel.cp_method=ring`` at cp > 1 (the step
    then hands it whole sequences); otherwise the micro batch as it is (no CP, or Ulysses, whose slices
    ``split_tokens`` already cut)."""
    if topo.cp > 1 and topo.plan.cp_method == "ring":
        mesh = topo.mesh["cp"]
        return lambda model, inputs, labels: ring_context(mesh, model, inputs, labels)
    return whole_batch
