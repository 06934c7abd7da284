"""The run plan: what a run's config and world size decide, made and validated once.

::

    plan = RunPlan.build(cfg, world_size, gpu=...)   # or RunPlan.for_launch(cfg): this launch's world
    topo = setup_distributed(plan)                  # process groups; topo.plan is this plan
    train(plan.config, topo)                        # reads topo.plan, never re-derives it

``build`` runs every cross-field layout rule (``parallel.layout.validate_layout``) and resolves
the precision, the device kind and the backend name, before any process group exists and on a
CPU-only login node too (``megafixed train --dry-run``, ``megafixed submit``, ``megafixed plan``
plan GPU runs there: ``gpu=True``). Everything downstream reads the plan instead of the whole
``Config`` plus loose ``precision``/engine arguments, so a layout key is read from the
config in one place (here) and checked once.

The plan holds no process state (ranks, groups, devices): that is the ``Topology`` of one process.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .config import Config, ConfigError
from .engines import engine_kind
from .parallel import layout as _layout
from .parallel.dims import ParallelDims
from .parallel.layout import BatchLayout


def _bf16_here(here: bool) -> bool:
    """Whether this machine's GPU computes bf16 (pre-Ampere ones, e.g. V100 and T4, do not); a plan for
    other machines (``gpu`` given) assumes they do."""
    if not here:
        return True
    import torch

    return torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_precision(cfg: Config, gpu: Optional[bool] = None, *, here: Optional[bool] = None) -> str:
    """``auto`` means bf16 on a GPU and fp32 on CPU (CPU bf16 matmuls are slow and inexact), and fp32
    on a GPU of this machine without bf16 (``here``: the run is for this machine; default ``gpu is None``).

    ``gpu`` is the machine the run is *for*: ``--dry-run`` on a CPU login node plans a GPU run.
    Not DeepSpeed's business: every engine trains in the precision the plan names.
    """
    here = gpu is None if here is None else here
    if gpu is None:
        import torch

        gpu = torch.cuda.is_available()
    p = cfg.train.precision
    if p == "auto":
        return "bf16" if gpu and _bf16_here(here) else "fp32"
    if p in ("bf16", "fp16") and not gpu:
        raise ConfigError(f"train.precision={p} needs a GPU; on CPU use train.precision=fp32 (or auto)")
    return p


@dataclass(frozen=True)
class BatchPlan(BatchLayout):
    """The batch arithmetic (global = micro * accum * dp) plus the sequence length."""
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class RunPlan:
    """One run's layout and numerics, for ``world_size`` ranks; immutable once built."""
    dims: ParallelDims  # named axes in grid order (megatron-core's tp-cp-ep-dp-pp)
    batch: BatchPlan
    precision: str  # resolved: "fp32" | "bf16" | "fp16"
    engine: str  # train.engine: a registered engine's name (megafixed.engines)
    device: str  # "cuda" | "cpu": where the ranks compute
    backend: str  # the torch.distributed backend: "nccl" | "gloo"
    sequence_parallel: bool
    collective_timeout_s: float
    cp_method: str = "ulysses"  # parallel.cp_method; read only when dims.cp > 1
    # The engine's own part (its ``EngineKind.make_plan``: DeepSpeed's zero_stage; the torch engine's
    # dp_replicate, reshard_after_forward and pipeline schedule)
    engine_plan: Any = None
    # The config it was built from: the command hands the plan over, and what runs reads this one, so a
    # plan and a config cannot disagree (no second validation, no list of the keys the plan read).
    config: Optional[Config] = field(default=None, compare=False, repr=False)

    @classmethod
    def build(cls, cfg: Config, world_size: int, *, gpu: Optional[bool] = None) -> "RunPlan":
        """Validate ``cfg`` for ``world_size`` ranks (``LayoutError``/``ConfigError`` naming the fix).

        ``gpu``: whether the machines the run is for have CUDA GPUs; None asks this machine.
        ``parallel.backend=gloo`` computes on CPU even there (today's rule, kept), and the
        precision follows the device the ranks compute on.
        """
        here = gpu is None
        if here:
            import torch

            gpu = torch.cuda.is_available()
        backend = cfg.parallel.backend
        on_gpu = gpu and backend != "gloo"
        if backend == "auto":
            backend = "nccl" if on_gpu else "gloo"
        elif backend == "nccl" and not gpu:
            where = "this machine has none (torch sees no CUDA device)" if here else "the run is planned for CPUs"
            raise _layout.LayoutError(f"parallel.backend=nccl needs CUDA GPUs, and {where}; use "
                                      f"parallel.backend=gloo (or auto) on CPU")
        if cfg.parallel.cp > 1 and cfg.parallel.cp_method == "ring" and not on_gpu:
            raise _layout.LayoutError("parallel.cp_method=ring needs CUDA GPUs (torch's context_parallel runs only "
                                      "the CUDA flash / memory-efficient / cuDNN attention kernels); use "
                                      "parallel.cp_method=ulysses on CPU")
        precision = resolve_precision(cfg, gpu=on_gpu, here=here)
        batch = _layout.validate_layout(cfg, world_size, precision)  # every cross-field rule, once
        kind = engine_kind(cfg.train.engine, error=ConfigError)
        dims = ParallelDims.of(dp=batch.dp, **_layout.model_parallel_axes(cfg.parallel))
        plan = cls(dims=dims,
                   batch=BatchPlan(global_batch=batch.global_batch, micro_batch=batch.micro_batch,
                                   accum=batch.accum, dp=batch.dp, seq_len=cfg.data.seq_len),
                   precision=precision, engine=kind.name,
                   device="cuda" if on_gpu else "cpu", backend=backend,
                   sequence_parallel=cfg.parallel.sequence_parallel,
                   collective_timeout_s=cfg.parallel.collective_timeout_s, cp_method=cfg.parallel.cp_method,
                   engine_plan=kind.make_plan(cfg, batch.dp, "cuda" if on_gpu else "cpu"), config=cfg)
        kind.check_supported(cfg, plan)  # the engine's own refusals, by name
        return plan

    @classmethod
    def for_launch(cls, cfg: Config) -> "RunPlan":
        """The plan for this launch's world (torchrun, the deepspeed launcher, srun or one plain
        process) on this machine; a half-set launcher environment fails first (``LaunchError``)."""
        from .launch.world import check_world, detect_world

        world = detect_world()
        check_world(world)
        return cls.build(cfg, world.size)

    # The layout's numbers, read as a Topology reads them (resume checks take either).
    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def describe(self) -> str:
        """One line: ``8 ranks = tp 2 x pp 2 x dp 2; global batch 16 = micro 2 x accum 4 x dp 2``
        (``tp 2 x cp 2 x pp 2 x dp 1`` with context parallelism)."""
        from .plural import count

        b = self.batch
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        return (f"{count(self.world_size, 'rank')} = tp {self.tp}{cp} x pp {self.pp} x dp {self.dp}; global batch "
                f"{b.global_batch} = micro {b.micro_batch} x accum {b.accum} x dp {b.dp}")
