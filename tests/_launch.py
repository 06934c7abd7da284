"""How the tests launch several ranks: torchrun on a free loopback port, big launches one at a time."""
from __future__ import annotations

import shutil
import socket
import sys

BIG_LOCK = "/tmp/megafixed-big.lock"  # at most one launch of 6+ processes alive on the machine (memory)


def big_lock(nproc: int) -> list[str]:
    """The prefix a launch of ``nproc`` processes runs under: ``flock BIG_LOCK`` from 6 ranks on (8 gloo
    ranks hold ~4 GB), so concurrent suites and benchmarks wait for each other; nothing below 6 ranks or
    where ``flock`` is missing."""
    return ["flock", BIG_LOCK] if nproc >= 6 and shutil.which("flock") else []


def torchrun_cmd(nproc: int, args: list[str]) -> list[str]:
    """``[flock ...] python -m torch.distributed.run --nproc-per-node N <args>`` on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [*big_lock(nproc), sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1", f"--master-port={port}", *args]
