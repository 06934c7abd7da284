"""Naming the rank (and node) that was lost mid-run, in one line, instead of a gloo/NCCL traceback.

When a node dies mid-step, the survivors' collective fails: at once if the peer's sockets were closed
(its processes were killed), or after ``parallel.collective_timeout_s`` if the peer just went silent
(a cut link, a hung node). The exception names at best an address, often a neighbour that itself only
failed in turn. So the survivors take a roll call on the rendezvous store (rank 0's TCPStore, which
outlives the broken process groups): every rank bumps a heartbeat counter there each second (a thread,
``rendezvous.start_heartbeat``), a survivor watches the counters for a few seconds, and the ranks whose
counter stands still are the lost ones; their hosts come from the rendezvous records. Where the store
itself is gone, rank 0's node is the one lost (or unreachable from here).
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Optional

from . import rendezvous

ROLL_CALL_S = 5.0  # how long a survivor watches the heartbeats (rendezvous.HEARTBEAT_S) before naming the silent
# what gloo / NCCL / c10d say when a peer went away (their exceptions are plain RuntimeErrors)
_MARKERS = ("connection closed by peer", "connection reset by peer", "timed out waiting", "broken pipe",
            "connection refused", "socket timeout", "nccl", "gloo", "timeout")


class LostPeerError(RuntimeError):
    """Ranks of this job were lost mid-run (exit 1). ``every_rank``: this rank is the one that reports."""

    def __init__(self, message: str, every_rank: bool):
        super().__init__(message)
        self.every_rank = every_rank


def is_comm_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _MARKERS)


def _beats(store, size: int) -> list[str]:
    return [v.decode() for v in store.multi_get([rendezvous.heartbeat_key(r) for r in range(size)])]


def roll_call(wait: float = ROLL_CALL_S) -> tuple[Optional[list[int]], str]:
    """(ranks alive, or None if the store is unreachable; what went wrong with the store).

    Alive: its heartbeat advanced during ``wait`` seconds, or it already took this roll call (a survivor
    that is about to exit stops beating). Independent of when the other survivors notice the failure."""
    import torch.distributed as dist

    store, size, rank = rendezvous.store(), dist.get_world_size(), dist.get_rank()
    if store is None:
        return None, "no rendezvous store"
    done = f"{rendezvous.PREFIX}/roll_call/{{}}"
    try:
        store.set_timeout(timedelta(seconds=wait))
        first = _beats(store, size)
        deadline = time.monotonic() + wait
        while True:
            time.sleep(0.5)
            now = _beats(store, size)
            alive = [r for r in range(size) if now[r] != first[r] or r == rank or store.check([done.format(r)])]
            if len(alive) == size or time.monotonic() > deadline:
                break
        store.set(done.format(rank), "1")
        if rank == 0:  # the store lives in this process: stay until the other survivors have answered
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and not all(store.check([done.format(r)]) for r in alive):
                time.sleep(0.2)
        return alive, ""
    except (RuntimeError, OSError) as exc:
        return None, str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__


def _where(ranks: list[int], peers: list[dict]) -> str:
    by_host: dict = {}
    for r in ranks:
        rec = peers[r] if r < len(peers) else {}
        by_host.setdefault((rec.get("host", "?"), rec.get("addr", "")), []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {rendezvous.ranges(rs)} on {host}"
                     + (f" ({addr})" if addr else "") for (host, addr), rs in by_host.items())


def lost_peer_error(exc: BaseException, run_dir: str, collective_timeout_s: float) -> Optional[LostPeerError]:
    """The one-line error for a collective that failed because peers were lost; None for any other failure."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or \
            not is_comm_failure(exc):
        return None
    size, rank, peers = dist.get_world_size(), dist.get_rank(), rendezvous.peers()
    alive, store_error = roll_call()
    from ..run.run_dir import RunDirectory

    rd = RunDirectory(run_dir)
    try:
        with open(rd.latest_file) as f:
            ckpt = f"The last checkpoint, {os.path.join(rd.checkpoints, f.read().strip())}, is intact"
    except OSError:
        ckpt = "No checkpoint was written yet"
    cause = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
    if alive is None:
        lost, reporter = [0], True  # the store lives in rank 0: its node is gone or unreachable from here
        what = f"lost contact with {_where([0], peers)}, which holds the job's store ({store_error})"
    else:
        lost = [r for r in range(size) if r not in alive]
        if not lost:
            return None  # everyone answered: not a lost peer (e.g. a collective misuse); show the real error
        reporter = rank == min(alive)
        what = f"lost {_where(lost, peers)}: {len(alive)} of {size} ranks answered after the failure"
    return LostPeerError(
        f"{what}; a collective failed ({cause}); collectives wait at most parallel.collective_timeout_s="
        f"{collective_timeout_s:g}s for a peer. {ckpt}: resubmit the job (or rerun the command) to resume from it, "
        f"on healthy nodes (sbatch --exclude=<node>)", every_rank=reporter)
