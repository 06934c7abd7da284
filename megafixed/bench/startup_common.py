"""What both start-up benchmarks run (``startup.py``: per engine; ``startup_world.py``: per world size)."""
from __future__ import annotations

import os
import socket

TINY = ("model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.code_bits=8",
        "model.max_seq_len=32", "data.seq_len=32", "data.mock=true", "train.max_steps=1", "train.global_batch=8",
        "train.micro_batch=4", "metrics.interval=1", "validation.interval=0",
        "metrics.tensorboard=false", "schedule.warmup_steps=0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    # A lone launch: no rendezvous variables from a caller's world; one thread per rank, as the tests run.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                             "LOCAL_RANK")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    return env
