"""Shared test set-up: DeepSpeed on CPU, a cached JIT-extension dir, and a torchrun helper."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# DeepSpeed picks its accelerator at import; CPU here (CI has no GPU). Its first run JIT-builds a
# comm op (~30 s), so the build is cached across test runs.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "megafixed" / "torch_extensions"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tokenizers and shards that tests prepare go to a throw-away cache, not the user's ~/.cache.
os.environ.setdefault("MEGAFIXED_CACHE_DIR", tempfile.mkdtemp(prefix="megafixed-test-cache-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_torchrun(nproc: int, args: list[str], cwd: str | os.PathLike | None = None,
                 timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Launch ``python -m torch.distributed.run --nproc-per-node N <args>`` on loopback (gloo)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={port}", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd or ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode})\nSTDOUT:\n{proc.stdout[-4000:]}\n"
                             f"STDERR:\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture
def torchrun():
    return run_torchrun
