"""The environment for a child process that must be its own launch (a lone run, an sbatch job)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

# An in-process test's 1-rank world leaves these in os.environ (DeepSpeed reads them); a child that
# inherited them would think it belongs to pytest's world, and srun tasks would see a foreign WORLD_SIZE.
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def launch_free_env(**extra: str) -> dict:
    return {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}, **extra}


def signal_after_logged_steps(cmd: list, cwd, metrics: Path, sig: int, steps: int = 3,
                              timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``cmd`` (a lone `megafixed train`), send it ``sig`` once it has logged ``steps`` steps (to
    ``metrics``) and paused before the next (``MEGAFIXED_PAUSE``: it cannot finish first, however fast),
    and return how it ended (its return code, stdout and stderr)."""
    from _pause import ended, pause_env, wait_paused

    paused = metrics.parent.with_name(metrics.parent.name + ".paused")
    log = paused.with_suffix(".err")  # a file, not a pipe: nobody reads a pipe while the run goes on
    with open(log, "w+") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=launch_free_env(**pause_env(f"train.step@{steps + 1}", paused)),
                                stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            wait_paused(paused, ended(proc, log), timeout=timeout)
            proc.send_signal(sig)
            out, _ = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err.read())
