"""``megafixed train CONFIG [overrides]``: train or resume a run with DeepSpeed.

Works as a plain process (one rank), under ``torchrun --nproc-per-node N`` or the ``deepspeed``
launcher. Running the same command again resumes from ``<run_dir>/checkpoints/latest``.
"""
from __future__ import annotations

import argparse
import os
import sys

from ..config import load_config

HELP = "train a model (DeepSpeed engine; single process, torchrun or deepspeed launcher); reruns resume"


def add_arguments(p):
    p.add_argument("config", help="YAML run config (examples/configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.max_steps=100")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help=argparse.SUPPRESS)  # passed by the deepspeed launcher; we read LOCAL_RANK


def run(args) -> int:
    from ..train.env import prepare_runtime_env
    from ..train.step import NonFiniteLossError

    prepare_runtime_env()  # before anything imports deepspeed
    try:
        cfg = load_config(args.config, args.overrides)
        from ..data.prepare import prepare_data
        from ..parallel import setup_distributed
        topo = setup_distributed(cfg)
        cfg = prepare_data(cfg, is_main=topo.is_main)
        _barrier()  # other ranks read the shards rank 0 may just have written
        from ..train.trainer import train
        result = train(cfg)
    except (ValueError, NonFiniteLossError) as exc:  # ConfigError, CheckpointError, DataError, ... name the fix
        print(f"error: {exc}", file=sys.stderr)
        _flush_and_exit(1)
    if result.step and (not os.environ.get("RANK") or os.environ.get("RANK") == "0"):
        print(f"done: {result.step} steps; metrics {os.path.join(result.run_dir, 'metrics.jsonl')}, "
              f"checkpoint {os.path.join(result.run_dir, 'checkpoints', result.checkpoint or '')}")
    _flush_and_exit(0)
    return 0


def _barrier() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()


def _flush_and_exit(code: int) -> None:
    """Leave without running DeepSpeed's atexit teardown, which has been seen to SIGABRT after a
    finished run; everything we own (metrics, checkpoints, `latest`) is already flushed and closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
