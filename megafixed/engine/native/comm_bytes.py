"""The collectives one training step issues, with their bytes per rank, by watching the dispatcher.

PyTorch's ``CommDebugMode`` counts collectives (c10d's and the functional ones DTensor issues) but
records no sizes, and its module tracker breaks inside non-reentrant activation checkpointing
(torch 2.13: ``parent_list`` empties during recomputation). So this is a plain dispatch mode over
CommDebugMode's own lists of collective ops, which adds, for every collective, the bytes of its
buffer on this rank: the gathered output of an all-gather, the unreduced input of a
reduce-scatter, the tensor of an all-reduce (NCCL-tests' "size"; the largest tensor argument or
result covers every signature, in-place c10d and functional alike). Bus bytes per rank follow from
it by the ring factors ``megafixed.parallel.traffic`` applies. Given the step's process groups by
mesh axis, it also adds each collective's bytes to its axis (``by_axis``: ``parallel.traffic``'s
``(axis, kind)`` keys), so the replicate axis' all-reduce is told from the loss mean's.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p", "other")


def kind_of(op_name: str) -> str:
    name = op_name.replace("allgather", "all_gather").replace("allreduce", "all_reduce").replace("alltoall",
                                                                                                  "all_to_all")
    if name.rsplit(".", 1)[-1] in P2P_OPS:
        return "p2p"  # a pipeline's sends and receives (each buffer once, as parallel.traffic counts them)
    for kind in KINDS[:-2]:
        if kind in name:
            return kind
    return "other"


def _bytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(obj) if isinstance(t, torch.Tensor))


class CommBytesMode(TorchDispatchMode):
    """Every collective's count and bytes on this rank, by kind (``bytes_by_kind``, ``calls_by_kind``)."""

    def __init__(self, axes: dict | None = None):
        super().__init__()
        self.bytes_by_kind: dict = defaultdict(int)
        self.calls_by_kind: dict = defaultdict(int)
        self.axes = dict(axes or {})  # process group name -> mesh axis (fake_measure._axis_groups)
        self.by_axis_kind: dict = defaultdict(lambda: {"calls": 0, "bytes": 0})
        self._ops = _collective_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor desugars it into local ops and collectives, which come back here
        out = func(*args, **(kwargs or {}))
        packet = func._overloadpacket
        if packet in self._ops:
            size = max([_bytes(a) for a in args] + [_bytes(out)])
            kind = kind_of(str(packet))
            self.bytes_by_kind[kind] += size
            self.calls_by_kind[kind] += 1
            axis = self.axes.get(_group_name(args, kwargs or {}), "other")
            self.by_axis_kind[f"{axis}.{kind}"]["calls"] += 1
            self.by_axis_kind[f"{axis}.{kind}"]["bytes"] += size
        return out

    def by_axis(self) -> dict:
        """``{"<axis>.<kind>": {"calls", "bytes"}}`` (``Traffic.as_dict()["by_axis"]``'s keys); a group
        not among ``axes`` is ``other``."""
        return {k: dict(v) for k, v in sorted(self.by_axis_kind.items())}

    def summary(self) -> dict:
        return {k: {"calls": self.calls_by_kind[k], "bytes": self.bytes_by_kind[k]} for k in KINDS
                if self.calls_by_kind[k]}


def _group_name(args, kwargs) -> str | None:
    """The process group a collective runs on: c10d's ops take the ``ProcessGroup`` (boxed, at the
    dispatcher), the functional ones (DTensor's) its name, a string."""
    import torch.distributed as dist

    names = None
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).group_name
            except (RuntimeError, TypeError):  # another ScriptObject (the reduce op)
                continue
        if isinstance(a, str):
            names = names if names is not None else set(dist.distributed_c10d._world.pg_names.values())
            if a in names:
                return a
    return None


P2P_OPS = ("send", "recv_", "recv_any_source_")  # c10d's point-to-point ops (CommDebugMode lists none)


def _collective_ops() -> set:
    """CommDebugMode's lists: c10d's in-place collectives and the functional ones (DTensor's), and
    c10d's point-to-point ops."""
    from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops

    p2p = {getattr(torch.ops.c10d, name) for name in P2P_OPS if hasattr(torch.ops.c10d, name)}
    return set(c10d_collective_ops) | set(NATIVE_TO_PY_MAPPING) | set(NATIVE_TO_PY_MAPPING.values()) | p2p
