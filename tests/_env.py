"""The environment for a child process that must be its own launch (a lone run, an sbatch job)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

# An in-process test's 1-rank world leaves these in os.environ (DeepSpeed reads them); a child that
# inherited them would think it belongs to pytest's world, and srun tasks would see a foreign WORLD_SIZE.
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def launch_free_env(**extra: str) -> dict:
    return {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}, **extra}


def signal_after_logged_steps(cmd: list, cwd, metrics: Path, sig: int, steps: int = 3,
                              timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``cmd`` (a lone `megafixed train`), send it ``sig`` once ``metrics`` holds ``steps`` records,
    and return how it ended (its return code, stdout and stderr)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=launch_free_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + timeout
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
