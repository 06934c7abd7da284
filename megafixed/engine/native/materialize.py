"""Storage and single-process initial values for a meta-device model of any sharding.

The torch engine builds the plain ``GPT`` on the meta device, lets tensor parallelism
(``parallelize_module``) and FSDP2 (``fully_shard``) turn its parameters into DTensors, and only
then gives each rank storage for *its* shards (torchtitan's order: no rank ever holds the full
model). ``materialize`` then fills every local shard with exactly the value the single-process
model has there: the full ``init_value`` of the parameter (one at a time, drawn from its own
generator, ``megafixed.model.gpt.param_seed``), cut by the parameter's own placements with
``distribute_tensor(..., src_data_rank=None)`` -- each rank slices its part locally, nothing is
sent -- so any mesh and placement (FSDP2's Shard(0), TP's Shard(0)/Shard(1)/Replicate, 2-D FSDP x
TP, HSDP's Replicate x Shard) starts from the single-process weights.
"""
from __future__ import annotations

import torch
from torch import nn

from ...model.gpt import init_parameters
from ..dtypes import restore_exact_buffers


def _ties(module: nn.Module) -> list[tuple[str, str]]:
    """(name, first name) of every parameter that is another one (``model.tie_embeddings``)."""
    first_name, ties = {}, []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            ties.append((name, first_name[id(p)]))
        first_name.setdefault(id(p), name)
    return ties


def _retie(module: nn.Module, ties: list[tuple[str, str]]) -> None:
    # to_empty gives every module a Parameter of its own, which unties shared weights.
    for name, first in ties:
        owner, attr = name.rsplit(".", 1)
        target = module.get_parameter(first)
        if module.get_parameter(name) is not target:
            setattr(module.get_submodule(owner), attr, target)


def placed_value(name: str, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``param``: a DTensor with its mesh and placements (each rank keeping
    only its own chunk), else ``full`` itself -- ``init_parameters``' ``local_slice`` for DTensors."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(param.device)
    if not isinstance(param, DTensor):
        return full
    # src_data_rank=None: every rank holds ``full`` already (the same generator draw), so each
    # keeps its own chunk without a scatter from a source rank.
    value = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    if value.to_local().shape != param.to_local().shape:  # a placement this slicing does not follow: a bug
        raise RuntimeError(f"{name}: local shard {tuple(value.to_local().shape)} does not fit "
                           f"{tuple(param.to_local().shape)}")
    return value  # same placements: init_parameters' copy_ is a local copy, nothing is sent


@torch.no_grad()
def materialize(module: nn.Module, model_cfg, seed: int, device, init_device=None) -> None:
    """Give every parameter of meta-device ``module`` storage on ``device`` and its single-process
    initial value (``init_value`` of its full shape, sliced by its placements); re-tie
    ``model.tie_embeddings``; reset the buffers (the fixed code's). Parameter names must be the
    plain-GPT keys (true of the GPT after TP, FSDP2, ``Module.compile`` and its own checkpointing).

    The one initialiser of both engines (``model.gpt.init_parameters``) fills the values: a DTensor's
    shape is the global one, so only the slicing is this engine's (the DeepSpeed engine slices plain
    megatron-core shards by their TP dim, ``megafixed.engine.deepspeed.model.build_model``). ``init_device``:
    where the values are drawn (``Topology.init_device``; None: the CPU)."""
    ties = _ties(module)
    module.to_empty(device=device)
    _retie(module, ties)
    init_parameters(module, model_cfg, seed, local_slice=placed_value, device=init_device)
    restore_exact_buffers(module)
