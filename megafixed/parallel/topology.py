"""Process-group setup for a run plan: this process's place in the grid, and its groups.

The layout was validated when its ``RunPlan`` was built (``megafixed.run_plan``, once per command,
before any process group exists); ``setup_distributed(plan)`` checks only what one process can
know (the launch's world size, this machine's CUDA and NCCL), then starts torch.distributed.

Rank order is the plan's grid (``parallel/dims.py``): megatron-core's default ``tp-cp-ep-dp-pp``,
which for our (tp, dp, pp) axes is DeepSpeed's ``PipeModelDataParallelTopology`` (pipe, data,
model; the last varies fastest)::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so tensor-parallel peers are neighbours (one node, fast links) and a pipeline stage spans a
contiguous block of ranks. Both engines build their own groups from this one order, so megatron's
TP group (used by its layers) and DeepSpeed's pipeline grid agree.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .layout import LayoutError

# ``plan`` below is a ``megafixed.run_plan.RunPlan``: built above this package and handed in, so it
# is not imported here (run_plan imports this package's layout rules; no cycle, not even for typing).
_RunPlan = Any


@dataclass(frozen=True)
class Topology:
    """Where this process sits in its run plan's (TP, PP, DP) grid, and its process groups.

    Built once per process by ``setup_distributed(plan)``; the sizes and this rank's coordinates are
    read from ``plan`` (held once, never copied), which the trainer also reads the batch, precision
    and the engine's part from. Everything downstream (TP, pipeline, the trainer, DeepSpeed's mpu)
    takes the Topology instead of re-reading ``cfg.parallel``. The engines' own registries
    (megatron-core's ``parallel_state``, DeepSpeed's pipeline grid) are derived in the same rank
    order, so they cannot disagree.
    """
    plan: _RunPlan  # the plan this process was set up for
    rank: int
    local_rank: int
    device: torch.device = torch.device("cpu")
    backend: str = "gloo"
    tp_group: Optional[Any] = None  # None: the default group (world) -- only when that is the right one
    dp_group: Optional[Any] = None
    # Context parallelism (plan.cp > 1): the ranks that split the same sequences, and the group the loss
    # mean and the gradient reduction span (dp x cp: every rank that saw other tokens of the global batch).
    # None without cp: the loss and gradients reduce over dp_group as before.
    cp_group: Optional[Any] = None
    dp_cp_group: Optional[Any] = None
    model_parallel_group: Optional[Any] = None  # TP x PP: one model replica
    # train.engine=torch: the run's DeviceMesh (megafixed.engine.native.mesh); tp_group/dp_group are its groups
    mesh: Optional[Any] = None
    # Where initial values are drawn (model.gpt.init_parameters). None: the CPU, identical weights on any
    # layout, what training does. The benchmark draws on the GPU: a serial CPU draw of a 1.7B model takes
    # about a minute, a GPU one well under a second; other values, the same distribution and step times.
    init_device: Optional[torch.device] = None

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def tp(self) -> int:
        return self.plan.tp

    @property
    def pp(self) -> int:
        return self.plan.pp

    @property
    def dp(self) -> int:
        return self.plan.dp

    @property
    def cp(self) -> int:
        return self.plan.cp

    @property
    def cp_rank(self) -> int:
        return self.plan.dims.coords(self.rank)["cp"]

    @property
    def loss_group(self) -> tuple[Optional[Any], int]:
        """(group, size) that a step's loss mean and its gradient reduction span: dp, times cp when the
        sequences are split (each context-parallel rank holds the loss of its own tokens)."""
        return (self.dp_cp_group, self.dp * self.cp) if self.cp > 1 else (self.dp_group, self.dp)

    @property
    def sequence_parallel(self) -> bool:
        return self.plan.sequence_parallel

    @property
    def tp_rank(self) -> int:
        return self.plan.dims.coords(self.rank)["tp"]

    @property
    def pp_rank(self) -> int:
        return self.plan.dims.coords(self.rank)["pp"]

    @property
    def dp_rank(self) -> int:
        return self.plan.dims.coords(self.rank)["dp"]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def launch_world() -> tuple[int, int, int]:
    """(world size, rank, local rank) from torchrun, the deepspeed launcher or a plain srun task
    (``megafixed.launch.world.detect_world``; raises LaunchError on a half-set environment)."""
    from ..launch.world import detect_world

    w = detect_world()
    return w.size, w.rank, w.local_rank


def check_machine(plan: _RunPlan) -> None:
    """Refuse a plan this machine cannot run (made for GPUs, or NCCL without it) before anything starts."""
    if plan.device == "cuda" and not torch.cuda.is_available():
        raise LayoutError("the run is planned for CUDA GPUs (parallel.backend=nccl or auto on a GPU machine), and "
                          "this machine has none (torch sees no CUDA device); use parallel.backend=gloo (or auto) "
                          "on CPU")
    if plan.backend == "nccl" and not torch.distributed.is_nccl_available():
        raise LayoutError("parallel.backend=nccl: this torch build has no NCCL; install a CUDA build of torch or "
                          "use parallel.backend=gloo")


def check_local_rank(local_rank: int, visible: int) -> None:
    """One GPU per local rank: refuse more ranks on a node than it shows GPUs (else "invalid device ordinal")."""
    if local_rank >= visible:
        raise LayoutError(f"local rank {local_rank} needs GPU {local_rank}, but this node shows {visible} "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most "
                          f"{visible} ranks per node (--nproc-per-node / --gpus-per-node)")


def setup_distributed(plan: _RunPlan, world=None) -> Topology:
    """Initialise torch.distributed and ``plan``'s groups for this process; return its Topology.

    Call it once per process with the plan the command built (``RunPlan.for_launch(cfg)``);
    ``world`` is this launch's ``megafixed.launch.world.LaunchWorld`` (default: detected). A
    single process without a launcher still gets a 1-rank process group, because DeepSpeed's
    engine needs one. Rank/world detection, its consistency checks and the rendezvous live in
    ``megafixed.launch.world``. The groups are the plan's engine's (``EngineKind.setup_groups``):
    megatron-core's ``parallel_state`` under TP/PP for the DeepSpeed engine; the torch engine's one
    ``DeviceMesh`` (``topo.mesh``, no megatron import) whose TP and DP groups the Topology carries.
    """
    import torch.distributed as dist

    from ..launch import world as launch
    from ..plural import count

    if not hasattr(plan, "dims"):  # the pre-plan call, setup_distributed(cfg): name the new one
        raise TypeError(f"setup_distributed takes a RunPlan (megafixed.run_plan.RunPlan.for_launch(cfg)), "
                        f"not {type(plan).__name__}")
    # Checked before anything waits on the network: an inconsistent environment fails in seconds.
    lw = world if world is not None else launch.detect_world()
    launch.check_world(lw)
    if lw.size != plan.world_size:
        raise LayoutError(f"this launch has {count(lw.size, 'rank')} but the run plan was made for "
                          f"{plan.world_size}; build the plan for this launch (RunPlan.for_launch)")
    check_machine(plan)
    rank, local_rank = lw.rank, lw.local_rank
    device = torch.device("cuda", local_rank) if plan.on_gpu else torch.device("cpu")
    if plan.on_gpu:
        check_local_rank(local_rank, torch.cuda.device_count())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        from ..launch import rendezvous

        launch.set_master_env(lw)  # a lone process gets a free loopback port, so two runs never collide
        # gives up after MEGAFIXED_RDZV_TIMEOUT, naming the missing ranks/nodes; collectives get their own bound
        rendezvous.init_process_group(lw, plan.backend, plan.collective_timeout_s,
                                      device_id=device if plan.backend == "nccl" else None)
        launch.check_agreement(lw)  # same job, same master, every node of the step in this one world
    from ..engines import kind_of

    groups = kind_of(plan).setup_groups(plan)  # the engine's own: megatron-core's, or a DeviceMesh
    topo = Topology(plan=plan, rank=rank, local_rank=local_rank, device=device, backend=plan.backend, **groups)
    if groups and topo.mesh is None and dist.get_rank(topo.tp_group) != topo.tp_rank:
        # Only reachable if a caller initialised megatron's groups with another layout first.
        raise LayoutError(f"megatron-core's parallel_state was initialised with another layout than "
                          f"parallel.tp={plan.tp}, parallel.pp={plan.pp}; call setup_distributed once per process")
    return topo
