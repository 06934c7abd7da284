"""What the DeepSpeed engine refuses by name, checked by the run plan before any process group (and
on a login node for ``--dry-run``); imports nothing heavy."""
from __future__ import annotations

from ...config import ConfigError


def check_supported(cfg, pp: int) -> None:
    if cfg.train.compile and pp > 1:
        # DeepSpeed's pipeline engine runs its stages' layers through its own schedule (activation
        # checkpointing, p2p buffers); compiling them is untested there, and silently running eager
        # would make `train.compile=true` a lie.
        raise ConfigError(f"train.compile=true is not supported with pipeline parallelism (parallel.pp="
                          f"{pp}); set train.compile=false, or parallel.pp=1")
