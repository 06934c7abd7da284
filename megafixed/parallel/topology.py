"""Process-group setup and the (TP, PP, DP) layout, checked before any process group exists.

Rank order is DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model; the last axis
varies fastest) and, identically, megatron-core's default order ``tp-cp-ep-dp-pp``::

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

from ..config import ConfigError


class LayoutError(ConfigError):
    """An impossible parallel layout; the message names the constraint and a fix."""


@dataclass
class Topology:
    world_size: int
    rank: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    device: torch.device = torch.device("cpu")
    mpu: Optional[Any] = None  # megatron-style model-parallel unit for deepspeed.initialize
    sequence_parallel: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def coords_of(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a global rank, in DeepSpeed's pipe/data/model order."""
    return rank // (tp * dp), (rank // tp) % dp, rank % tp


def check_layout(cfg, world: int) -> int:
    """Raise ``LayoutError`` for a layout that cannot work; return the data-parallel size.

    Called before any process group is built, so a bad layout fails in a second with a message
    rather than as a hang or a shape error deep inside a collective.
    """
    tp, pp, sp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.sequence_parallel
    m = cfg.model
    if tp < 1 or pp < 1:
        raise LayoutError(f"parallel.tp={tp} and parallel.pp={pp} must both be >= 1")
    if world % (tp * pp):
        raise LayoutError(f"world size {world} is not divisible by parallel.tp * parallel.pp = {tp}*{pp}; "
                          f"launch a multiple of {tp * pp} processes or change the layout")
    dp = world // (tp * pp)
    if pp > 1 and cfg.zero.stage >= 2:
        raise LayoutError(f"zero.stage={cfg.zero.stage} cannot be combined with parallel.pp={pp} "
                          f"(DeepSpeed's pipeline engine refuses it); use zero.stage=1")
    if pp > 1 and cfg.zero.stage == 0 and cfg.optimizer.grad_clip > 0:
        # DeepSpeed's clip_grad_norm_ (used without ZeRO) keeps a non-TP parameter's gradient
        # only on the replica's model-parallel rank 0, i.e. on the first pipeline stage: the
        # other stages' parameters would be left out of the clipping norm.
        raise LayoutError(f"zero.stage=0 with parallel.pp={pp} would clip gradients by a wrong norm "
                          f"(DeepSpeed counts only the first stage's parameters); use zero.stage=1, "
                          f"which costs the same communication")
    if m.n_heads % tp:
        raise LayoutError(f"model.n_heads={m.n_heads} is not divisible by parallel.tp={tp}; each "
                          f"tensor-parallel rank needs whole attention heads")
    if m.kv_heads % tp:
        raise LayoutError(f"model.n_kv_heads={m.kv_heads} is not divisible by parallel.tp={tp}; use "
                          f"more key/value heads or a smaller parallel.tp")
    if m.ffn_dim % tp:
        raise LayoutError(f"MLP width {m.ffn_dim} (model.ffn_hidden) is not divisible by parallel.tp={tp}")
    if m.vocab_size % tp:
        raise LayoutError(f"model.vocab_size={m.vocab_size} is not divisible by parallel.tp={tp}; pad the "
                          f"vocabulary to a multiple of {tp} (the output head is split by vocabulary rows)")
    # A stage must own at least one block: a stage of only codes or only the head would idle
    # while holding a full activation buffer. Uneven counts are allowed (the partitioner balances
    # parameters, not layer counts), e.g. 6 layers on 4 stages.
    if m.n_layers < pp:
        raise LayoutError(f"model.n_layers={m.n_layers} is fewer than parallel.pp={pp} pipeline stages; "
                          f"every stage needs at least one block")
    if pp > 1 and m.tie_embeddings:
        raise LayoutError("model.tie_embeddings=true is not supported with parallel.pp > 1 (the table and "
                          "the head live on different stages); untie them or use parallel.pp=1")
    if sp and tp == 1:
        raise LayoutError("parallel.sequence_parallel=true needs parallel.tp > 1 (it splits the sequence "
                          "over the tensor-parallel group)")
    if sp and cfg.data.seq_len % tp:
        raise LayoutError(f"data.seq_len={cfg.data.seq_len} is not divisible by parallel.tp={tp}, which "
                          f"sequence parallelism needs (each rank holds seq_len/tp positions)")
    per_step = cfg.train.micro_batch * dp
    if cfg.train.global_batch % per_step:
        raise LayoutError(f"train.global_batch={cfg.train.global_batch} is not divisible by "
                          f"train.micro_batch * data-parallel size = {cfg.train.micro_batch}*{dp}; "
                          f"choose a global batch that is a multiple of {per_step}")
    return dp


def _env_int(*names: str, default: int) -> int:
    for n in names:
        if os.environ.get(n) not in (None, ""):
            return int(os.environ[n])
    return default


def setup_distributed(cfg) -> Topology:
    """Check the layout, initialise torch.distributed (gloo on CPU, NCCL on GPU) and the groups.

    A single process without a launcher still gets a 1-rank process group, because DeepSpeed's
    engine needs one; we give it a free loopback port so two such runs never collide.
    """
    import torch.distributed as dist

    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    dp = check_layout(cfg, world)
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    use_cuda = torch.cuda.is_available() and cfg.parallel.backend != "gloo"
    backend = cfg.parallel.backend if cfg.parallel.backend != "auto" else ("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT") or str(_free_port())
        os.environ.setdefault("WORLD_SIZE", str(world))
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    pp_rank, dp_rank, tp_rank = coords_of(rank, tp, dp)
    mpu = None
    if tp > 1:
        # megatron-core's layers find their TP group through parallel_state; its default order
        # equals DeepSpeed's pipe/data/model topology (see the module docstring).
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                     pipeline_model_parallel_size=pp,
                                                     create_gloo_process_groups=False)
        assert parallel_state.get_tensor_model_parallel_rank() == tp_rank, "rank order mismatch"
        if pp == 1:
            mpu = MegatronMPU()
    # With pp > 1 DeepSpeed insists on mpu=None and takes the pipeline module's own grid
    # (same rank order), so ``mpu`` stays None there.
    return Topology(world_size=world, rank=rank, local_rank=local_rank, tp=tp, pp=pp, dp=dp,
                    tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank, device=device, mpu=mpu,
                    sequence_parallel=cfg.parallel.sequence_parallel)


class MegatronMPU:
    """The model-parallel unit DeepSpeed 0.19 queries, answered from megatron-core's parallel_state.

    megatron-core 0.16 no longer has ``get_model_parallel_rank/world_size`` (DeepSpeed still calls
    them for checkpoint file names and the gradient-norm reduction), so this adapter spells out
    exactly the calls DeepSpeed makes. "Model parallel" means TP x PP (one model replica).
    """

    def __init__(self):
        from megatron.core import parallel_state as ps
        self._ps = ps

    # tensor parallel
    def get_tensor_model_parallel_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_group(self):
        return self._ps.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_src_rank()

    # pipeline parallel
    def get_pipeline_model_parallel_rank(self) -> int:
        return self._ps.get_pipeline_model_parallel_rank()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._ps.get_pipeline_model_parallel_world_size()

    def get_pipeline_model_parallel_group(self):
        return self._ps.get_pipeline_model_parallel_group()

    # model parallel = one replica (TP x PP)
    def get_model_parallel_group(self):
        return self._ps.get_model_parallel_group()

    def get_model_parallel_world_size(self) -> int:
        import torch.distributed as dist
        return dist.get_world_size(group=self.get_model_parallel_group())

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist
        return dist.get_rank(group=self.get_model_parallel_group())

    # data parallel
    def get_data_parallel_group(self):
        return self._ps.get_data_parallel_group()

    def get_data_parallel_rank(self) -> int:
        return self._ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self._ps.get_data_parallel_world_size()

    def get_data_parallel_group_ranks(self) -> list[int]:
        import torch.distributed as dist
        return dist.get_process_group_ranks(self.get_data_parallel_group())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
