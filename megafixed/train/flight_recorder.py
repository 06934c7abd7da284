"""NCCL's flight recorder beside a hang's Python stacks (``train/watchdog.py``): the last collectives of
every process group of this rank, each with its sequence number, state (scheduled, started, completed),
sizes and the Python stack that issued it -- which collective a hung rank is in, and which rank never
joined it. torch keeps the record only when ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (entries, e.g. 2000) is set
before the process group is made; without it the dump holds no entries. Each rank writes
``<folder>/rank_<R>``, the layout torch's analyzer reads: ``python -m torch.distributed.flight_recorder.fr_trace
<folder> -p rank_`` (or ``pickle.load`` one file)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional


def dump_flight_recorder(folder: Path, rank: int) -> Optional[Path]:
    """``folder/rank_<rank>``, or None: not on CUDA with NCCL, or torch has no recorder to dump."""
    import torch
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_available() and dist.is_initialized()):
        return None
    with contextlib.suppress(Exception):
        if "nccl" not in str(dist.get_backend()).lower():
            return None
        c10d = torch._C._distributed_c10d
        dump = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
        if dump is None:
            return None
        data = dump()  # collectives and their stacks, completed ones too: the default
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank_{rank}"
        path.write_bytes(data)
        return path
    return None
