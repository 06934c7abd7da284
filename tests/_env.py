"""The environment for a child process that must be its own launch (a lone run, an sbatch job)."""
from __future__ import annotations

import os

# An in-process test's 1-rank world leaves these in os.environ (DeepSpeed reads them); a child that
# inherited them would think it belongs to pytest's world, and srun tasks would see a foreign WORLD_SIZE.
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def launch_free_env(**extra: str) -> dict:
    return {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}, **extra}
