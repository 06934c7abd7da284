"""The torch engine's ``DeviceMesh``: the run plan's (DP, TP) grid with named dimensions.

A 3-D mesh ``("dp_replicate", "dp_shard", "tp")`` over the ranks in the plan's own order
(``megafixed.parallel.dims``: tensor-parallel peers are neighbours)::

    rank = tp_rank + tp * dp_rank,    dp_rank = r * dp_shard + s

with ``"dp"`` flattened from the first two, so ``mesh["dp"]`` is exactly the data-parallel group
the data loader and the loss mean use (its ranks read the same shards as under DeepSpeed), and
``mesh["dp_replicate", "dp_shard"]`` is the 2-D mesh HSDP shards over (torchtitan's names).
With pipeline parallelism (parallel.pp > 1) a leading ``"pp"`` axis is added, torchtitan's
``("pp", "dp_replicate", "dp_shard", "tp")``: pipeline stages are the slowest-varying coordinate,
as in the plan's order (``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``), and every other
dimension is sliced within one stage. Without it the mesh keeps its three dimensions.

With context parallelism (parallel.cp > 1) a ``"cp"`` axis sits between ``dp_shard`` and ``tp``,
``(pp?, dp_replicate, dp_shard, cp, tp)``, the plan's order (``rank = tp_rank + tp * (cp_rank + cp *
(dp_rank + dp * pp_rank))``). Each CP rank holds other tokens of the same sequences, so its
gradients are reduced with the data-parallel ones: FSDP2 shards over ``dp_shard`` and ``cp``
flattened (``"dp_shard_cp"``, torchtitan's name; HSDP: ``(dp_replicate, dp_shard_cp)``), and the
loss mean spans ``"dp_cp"`` (every data- and context-parallel rank). Without cp nothing changes.

Imports only torch: ``megafixed.parallel.topology`` calls it while setting up the process groups.
"""
from __future__ import annotations

import math
from typing import Any

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
DP = "dp"  # the flattened (dp_replicate, dp_shard) dimension
PP = "pp"  # the pipeline dimension, first, only when parallel.pp > 1
CP = "cp"  # the context-parallel dimension, before tp, only when parallel.cp > 1
DP_SHARD_CP = "dp_shard_cp"  # (dp_shard, cp) flattened: what FSDP2 shards over under CP
DP_CP = "dp_cp"  # (dp_replicate, dp_shard, cp) flattened: the loss mean's group under CP


def mesh_shape(dp: int, tp: int, dp_replicate: int) -> tuple[int, int, int]:
    """(dp_replicate, dp_shard, tp): ``dp_replicate`` must divide ``dp`` (the run plan checked it)."""
    if dp_replicate < 1 or dp % dp_replicate:
        raise ValueError(f"dp_replicate={dp_replicate} does not divide the data-parallel size {dp}")
    return dp_replicate, dp // dp_replicate, tp


def build_mesh(topo, dp_replicate: int) -> Any:
    """This run's mesh (``torch.distributed`` must be initialised; every rank calls it).

    ``topo``: anything with ``dp``, ``tp``, ``pp`` and ``device`` (a ``Topology``, or the ``RunPlan``
    that ``setup_distributed`` builds it from)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    pp, cp = getattr(topo, "pp", 1), getattr(topo, "cp", 1)
    shape, names = mesh_shape(topo.dp, topo.tp, dp_replicate), MESH_DIMS
    if cp > 1:
        shape, names = (*shape[:2], cp, shape[2]), (*names[:2], CP, names[2])
    if pp > 1:
        shape, names = (pp, *shape), (PP, *names)
    device_type = torch.device(topo.device).type
    # Rank r sits at row-major position r: tp varies fastest, then cp, dp_shard, dp_replicate (then pp),
    # which is the plan's grid order (megatron-core's tp-cp-ep-dp-pp).
    ranks = torch.arange(math.prod(shape)).reshape(shape)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names)
    dp_submesh(mesh)  # made now, on every rank together (it may create a process group)
    if cp > 1:  # CP's flattened meshes too, now, on every rank together
        dp_mesh(mesh)
        dp_cp_submesh(mesh)
    return mesh


def mesh_groups(mesh) -> dict:
    """A ``Topology``'s groups from a ``build_mesh`` mesh: the mesh itself, tp, dp (and model-parallel:
    tp), and under context parallelism cp and dp x cp (``Topology.cp_group``, ``dp_cp_group``)."""
    tp_group = mesh["tp"].get_group()
    groups = dict(mesh=mesh, tp_group=tp_group, dp_group=dp_submesh(mesh).get_group(),
                  model_parallel_group=tp_group)
    if has_cp(mesh):
        groups.update(cp_group=mesh[CP].get_group(), dp_cp_group=dp_cp_submesh(mesh).get_group())
    return groups


def has_cp(mesh) -> bool:
    return CP in (mesh.mesh_dim_names or ())


def dp_cp_submesh(mesh) -> Any:
    """The 1-D mesh of every data- and context-parallel rank (``"dp_cp"``; ``build_mesh`` made it)."""
    return mesh["dp_replicate", "dp_shard", CP]._flatten(DP_CP)


def dp_submesh(mesh) -> Any:
    """The 1-D data-parallel mesh ("dp": dp_replicate x dp_shard flattened) of a ``build_mesh`` mesh.

    torch's own way to name a merged dimension, and torch keeps it: the root mesh holds its flattened
    meshes by name, and flattening again returns the one made first (no second process group).
    Slicing a flattened dimension from the root (``mesh["dp"]``) is deprecated from torch 2.11 on."""
    return mesh["dp_replicate", "dp_shard"]._flatten(DP)


def dp_mesh(mesh) -> Any:
    """The mesh FSDP2 shards over: 1-D ``dp_shard`` (FSDP), or 2-D (``dp_replicate``, ``dp_shard``)
    for HSDP, whose first dimension holds replicas (``fully_shard``'s convention). Under CP the shard
    dimension is ``dp_shard_cp`` (``dp_shard`` x ``cp``), so that gradients reduce over cp too."""
    if not has_cp(mesh):
        return mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
    # the flattened mesh itself (slicing a flattened dimension from the root is deprecated); HSDP's
    # 2-D mesh joins it to dp_replicate (both are slices of the same root)
    from torch.distributed.device_mesh import DeviceMesh

    shard = mesh["dp_shard", CP]._flatten(DP_SHARD_CP)  # the one build_mesh made
    if mesh["dp_replicate"].size() > 1:
        return DeviceMesh._concatenate([mesh["dp_replicate"], shard])
    return shard


def job_group(mesh) -> Any:
    """The process group over every rank of ``mesh``'s root mesh: the whole job, in one group, for
    the reductions every rank must agree on to the bit (the gradient norm). The default group when
    the root spans the world (no second communicator to create); otherwise the root flattened,
    once per root, on the first call (every rank of the root makes it together; the root mesh keeps
    it, as it keeps ``dp_submesh``'s)."""
    import torch.distributed as dist

    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    if root.size() == dist.get_world_size():
        return None
    flat = root._flatten("_".join(root.mesh_dim_names or ()) or "job") if root.ndim > 1 else root
    return flat.get_group()
