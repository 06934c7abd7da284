"""Gradient reductions that the engines do not know about: sequence-parallel parameters.

Under sequence parallelism the norms (and row-parallel biases) see only this rank's T/tp
positions, so their gradients are partial sums over the sequence and must be summed across the
TP group before DeepSpeed's data-parallel reduction (Megatron's ``sequence_parallel`` attribute).
Megatron does that once per optimizer step, at the accumulation boundary, with one coalesced
all-reduce (``finalize_model_grads``); so do we wherever DeepSpeed leaves the gradients in place
until the boundary:

The engine tells it where a gradient is at the boundary (``grad_of``: DeepSpeed's BF16 optimizer
keeps it in ``_hp_grad``, ``megafixed.engine.deepspeed.engine.hp_grad``). In the DeepSpeed engine:

* plain engine, ZeRO 0/1: ``TPGradSync.finish`` runs after the last micro batch's backward with
  DeepSpeed's backward all-reduce deferred (``engine.enable_backward_allreduce = False``), then
  hands over to ``engine.allreduce_gradients()``;
* pipeline engine (ZeRO 0/1): its ``ReduceTiedGrads`` instruction, which runs once per step just
  before ``ReduceGrads``, calls ``finish`` through ``GPTPipelineModule``.

ZeRO 2/3 reduce-scatter every parameter inside backward, on every micro batch (DeepSpeed's
design), so there is no later point: the TP sum has to happen in a gradient hook before theirs.
``TPGradSync.install_hooks`` does that; it is the only per-parameter path and only for ZeRO >= 2.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.requires_grad]


class TPGradSync:
    """Sum sequence-parallel gradients over the TP group: once per step, coalesced."""

    def __init__(self, params: list[nn.Parameter], group, grad_of: Callable = lambda p: p.grad):
        self.params = params
        self.group = group
        self.grad_of = grad_of  # where the engine keeps a parameter's gradient at the boundary

    @classmethod
    def for_module(cls, module: nn.Module, topo, grad_of: Callable = lambda p: p.grad) -> "TPGradSync | None":
        params = sequence_parallel_params(module)
        return cls(params, topo.tp_group, grad_of) if params and topo.tp > 1 else None

    @torch.no_grad()
    def finish(self) -> None:
        """One all-reduce of every sequence-parallel gradient, flattened (per dtype)."""
        grads = [g for g in (self.grad_of(p) for p in self.params) if g is not None]
        by_dtype: dict = {}
        for g in grads:
            by_dtype.setdefault((g.dtype, g.device), []).append(g)
        for group in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(group)
            dist.all_reduce(flat, group=self.group)
            for g, synced in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                g.copy_(synced)

    def install_hooks(self) -> None:
        """ZeRO >= 2 only: sum each gradient over TP as autograd produces it (see module docstring)."""
        group = self.group

        def hook(grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            return grad

        for p in self.params:
            p.register_hook(hook)
