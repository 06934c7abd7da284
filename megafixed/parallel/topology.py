"""Process-group setup and the (TP, PP, DP) layout, checked before any process group exists.

Rank order is DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model; the last axis
varies fastest) and, identically, megatron-core's default order ``tp-cp-ep-dp-pp``::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so tensor-parallel peers are neighbours (one node, fast links) and a pipeline stage spans a
contiguous block of ranks. Both engines build their own groups from this one order, so megatron's
TP group (used by its layers) and DeepSpeed's pipeline grid agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .layout import LayoutError


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the (TP, PP, DP) layout, and its process groups.

    Built once per process by ``setup_distributed``; everything downstream (TP, pipeline, the
    trainer, DeepSpeed's mpu) takes it instead of re-reading ``cfg.parallel``. The engines' own
    registries (megatron-core's ``parallel_state``, DeepSpeed's pipeline grid) are derived from it
    in the same rank order, so they cannot disagree.
    """
    world_size: int
    rank: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    sequence_parallel: bool = False
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str = "gloo"
    tp_group: Optional[Any] = None  # None: the default group (world) -- only when that is the right one
    dp_group: Optional[Any] = None
    model_parallel_group: Optional[Any] = None  # TP x PP: one model replica

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def mpu(self):
        """The model-parallel unit for ``deepspeed.initialize(mpu=...)``: needed under TP so that
        ZeRO partitions over the DP group and the gradient norm counts each parameter once. With a
        pipeline, DeepSpeed insists on None and builds its grid from the same numbers."""
        return TopologyMPU(self) if self.tp > 1 and self.pp == 1 else None


def coords_of(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a global rank, in DeepSpeed's pipe/data/model order."""
    return rank // (tp * dp), (rank // tp) % dp, rank % tp


def launch_world() -> tuple[int, int, int]:
    """(world size, rank, local rank) from torchrun, the deepspeed launcher or a plain srun task
    (``megafixed.launch.world.detect_world``; raises LaunchError on a half-set environment)."""
    from ..launch.world import detect_world

    w = detect_world()
    return w.size, w.rank, w.local_rank


def resolve_backend(parallel) -> tuple[str, bool]:
    """(backend, use_cuda); refuses a backend this machine cannot run before anything starts."""
    cuda = torch.cuda.is_available()
    if parallel.backend == "nccl" and not cuda:
        raise LayoutError("parallel.backend=nccl needs CUDA GPUs, and this machine has none (torch sees no "
                          "CUDA device); use parallel.backend=gloo (or auto) on CPU")
    if parallel.backend == "nccl" and not torch.distributed.is_nccl_available():
        raise LayoutError("parallel.backend=nccl: this torch build has no NCCL; install a CUDA build of torch or "
                          "use parallel.backend=gloo")
    use_cuda = cuda and parallel.backend != "gloo"
    return (parallel.backend if parallel.backend != "auto" else ("nccl" if use_cuda else "gloo")), use_cuda


def setup_distributed(cfg) -> Topology:
    """Validate the layout, initialise torch.distributed and the groups, return the Topology.

    Call it once per process. A single process without a launcher still gets a 1-rank process
    group, because DeepSpeed's engine needs one. Rank/world detection, its consistency checks and
    the rendezvous live in ``megafixed.launch.world``.
    """
    import torch.distributed as dist

    from ..launch import world as launch
    from .layout import validate_layout

    # Checked before anything waits on the network: an inconsistent environment fails in seconds.
    lw = launch.detect_world()
    launch.check_world(lw)
    world, rank, local_rank = lw.size, lw.rank, lw.local_rank
    dp = validate_layout(cfg, world).dp
    backend, use_cuda = resolve_backend(cfg.parallel)
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        from ..launch import rendezvous

        launch.set_master_env(lw)  # a lone process gets a free loopback port, so two runs never collide
        # gives up after MEGAFIXED_RDZV_TIMEOUT, naming the missing ranks/nodes; collectives get their own bound
        rendezvous.init_process_group(lw, backend, cfg.parallel.collective_timeout_s)
        launch.check_agreement(lw)  # same job, same master, every node of the step in this one world
    pp_rank, dp_rank, tp_rank = coords_of(rank, tp, dp)
    groups = {}
    if tp > 1 or pp > 1:
        # megatron-core's layers find their TP group through parallel_state, so its groups are the
        # ones we keep. Its default order (tp-cp-ep-dp-pp) is DeepSpeed's pipe/data/model order.
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         create_gloo_process_groups=False)
        groups = dict(tp_group=ps.get_tensor_model_parallel_group(), dp_group=ps.get_data_parallel_group(),
                      model_parallel_group=ps.get_model_parallel_group())
    topo = Topology(world_size=world, rank=rank, local_rank=local_rank, tp=tp, pp=pp, dp=dp,
                    sequence_parallel=cfg.parallel.sequence_parallel, tp_rank=tp_rank, pp_rank=pp_rank,
                    dp_rank=dp_rank, device=device, backend=backend, **groups)
    if groups and dist.get_rank(topo.tp_group) != tp_rank:
        # Only reachable if a caller initialised megatron's groups with another layout first.
        raise LayoutError(f"megatron-core's parallel_state was initialised with another layout than "
                          f"parallel.tp={tp}, parallel.pp={pp}; call setup_distributed once per process")
    return topo


class TopologyMPU:
    """The model-parallel unit DeepSpeed 0.19 queries, answered from the Topology.

    megatron-core 0.16 no longer has ``get_model_parallel_rank/world_size`` (DeepSpeed still calls
    them for checkpoint file names and the gradient-norm reduction), so this adapter spells out
    exactly the calls DeepSpeed makes. "Model parallel" means TP x PP (one model replica).
    """

    def __init__(self, topo: Topology):
        self.topo = topo

    # tensor parallel
    def get_tensor_model_parallel_rank(self) -> int:
        return self.topo.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.topo.tp

    def get_tensor_model_parallel_group(self):
        return self.topo.tp_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.topo.rank - self.topo.tp_rank

    # pipeline parallel
    def get_pipeline_model_parallel_rank(self) -> int:
        return self.topo.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.topo.pp

    def get_pipeline_model_parallel_group(self):
        from megatron.core import parallel_state as ps
        return ps.get_pipeline_model_parallel_group()

    # model parallel = one replica (TP x PP)
    def get_model_parallel_group(self):
        return self.topo.model_parallel_group

    def get_model_parallel_world_size(self) -> int:
        return self.topo.tp * self.topo.pp

    def get_model_parallel_rank(self) -> int:
        return self.topo.pp_rank * self.topo.tp + self.topo.tp_rank

    # data parallel
    def get_data_parallel_group(self):
        return self.topo.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.topo.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.topo.dp

    def get_data_parallel_group_ranks(self) -> list[int]:
        import torch.distributed as dist
        return dist.get_process_group_ranks(self.topo.dp_group)

