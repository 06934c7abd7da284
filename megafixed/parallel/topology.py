"""Process-group setup from torchrun, the deepspeed launcher, srun, or a plain single process."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch


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

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(*names: str, default: int) -> int:
    for n in names:
        if os.environ.get(n) not in (None, ""):
            return int(os.environ[n])
    return default


def setup_distributed(cfg) -> Topology:
    """Initialise torch.distributed (gloo on CPU, NCCL on GPU) and the DP layout.

    A single process without a launcher still gets a 1-rank process group, because DeepSpeed's
    engine needs one; we give it a free loopback port so two such runs never collide.
    """
    import torch.distributed as dist

    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by parallel.tp * parallel.pp = {tp}*{pp}; "
                         f"launch a multiple of {tp * pp} processes or change the layout")
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
    return Topology(world_size=world, rank=rank, local_rank=local_rank, tp=tp, pp=pp,
                    dp=world // (tp * pp), dp_rank=rank // (tp * pp), device=device)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
