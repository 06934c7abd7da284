"""The rendezvous: every rank meets the others at MASTER_ADDR:MASTER_PORT, once, within one deadline.

Why not ``torch.distributed.rendezvous("env://")``: its TCPStore client blocks inside C++ while it
retries, so a rank whose master never comes ignores SIGTERM (Python handlers only run between
bytecodes), waits up to twice the timeout (two connect tries), and dies with c10d's line only. Here:

* the master (rank 0) opens the TCPStore server without waiting in C++ for the workers; the other
  ranks probe the port from Python (short socket connects) until it answers, then connect;
* every rank posts a small record (host, address, job, code fingerprint) and counts itself in; all
  ranks poll the count in Python, with ONE deadline (``MEGAFIXED_RDZV_TIMEOUT``) for the whole meeting;
* SIGTERM/SIGINT during the meeting end the process at once, with a line saying so (exit 128+sig);
* on the deadline, the ranks that arrived name the ranks, and through Slurm's task layout the nodes,
  that never came; a rank that cannot reach the master names it;
* once everyone is there, the records are compared: a node running another megafixed revision (or torch)
  is refused, naming it, before any process group exists.

The records stay available (``peers()``) so that a later lost-peer failure can name the node of an address.

What the store exposes: torch's TCPStore has no authentication. Rank 0 listens on MASTER_PORT at the
address MASTER_ADDR names (``master_listen_fd``: a socket bound here; every interface only when that
address is not this node's), and anyone who reaches it can read the records and write keys -- the
cluster network is trusted, as torch itself assumes. A one-process run meets nobody: its store is an
in-memory ``HashStore``, and no socket is opened for it (docs/security.md).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

from .. import env as env_vars
from .world import LaunchError, World, ranges

PREFIX = "megafixed/rdzv"
HEARTBEAT_S = 1.0  # each rank bumps its counter in the store this often, for naming lost ranks later (lost.py)
_PEERS: list[dict] = []  # every rank's record, once the rendezvous succeeded
_STORE = None  # the rendezvous store, kept for diagnosing a lost peer later


class RendezvousError(LaunchError):
    """A failed rendezvous. ``every_rank``: print it on every rank (not only rank 0), because rank 0 may
    be exactly the rank that is missing."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


def rdzv_timeout() -> float:
    from .world import RDZV_TIMEOUT_S

    raw = env_vars.rdzv_timeout() or str(RDZV_TIMEOUT_S)
    try:
        value = float(raw)
    except ValueError:
        raise LaunchError(f"MEGAFIXED_RDZV_TIMEOUT={raw!r} is not a number of seconds; unset it (default "
                          f"{RDZV_TIMEOUT_S}) or set e.g. 300") from None
    if not 1 <= value <= 86400:
        raise LaunchError(f"MEGAFIXED_RDZV_TIMEOUT={raw}: must be between 1 and 86400 seconds")
    return value


def code_fingerprint() -> str:
    """A short hash of megafixed's own source files: equal on two nodes iff they run the same code
    (a git revision misses an installed wheel, an edited file or a stale copy on one node)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".sbatch") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def peers() -> list[dict]:
    return list(_PEERS)


def store():
    return _STORE


@contextlib.contextmanager
def signals_end_the_rendezvous(rank: int, size: int):
    """SIGTERM/SIGINT while waiting for peers: leave now. Nothing was trained, so there is nothing to save,
    and a scheduler's TERM (scancel, preemption) must not wait out the rendezvous timeout."""
    def leave(signum, _frame):
        name = signal.Signals(signum).name
        sys.stderr.write(f"megafixed: {name} during the rendezvous (rank {rank} of {size}): exiting now; nothing was "
                         f"trained or saved\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(128 + signum)

    if threading.current_thread() is not threading.main_thread():  # Python allows handlers in the main thread only
        yield
        return
    previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _remaining(deadline: float) -> float:
    return deadline - time.monotonic()


def _wait_for_master(addr: str, port: int, deadline: float, world: World, wait: float) -> None:
    """Probe the master's port from Python until it accepts (signals stay deliverable between tries)."""
    last = "no answer"
    while True:
        left = _remaining(deadline)
        if left <= 0:
            raise RendezvousError(
                f"rendezvous failed: rank {world.rank} of {world.size} ({world.source}) could not reach the master "
                f"(rank 0) at MASTER_ADDR={addr}:{port} within {wait:g}s ({last}). Rank 0 never started or died, or "
                f"{addr} is not its address seen from this node, or a firewall drops the port; check rank 0's log "
                f"and that every rank got the same MASTER_ADDR/MASTER_PORT (MEGAFIXED_RDZV_TIMEOUT sets the wait)",
                every_rank=True)
        try:
            with socket.create_connection((addr, port), timeout=min(2.0, max(left, 0.1))):
                return
        except socket.gaierror as exc:
            raise RendezvousError(f"rendezvous failed: MASTER_ADDR={addr} does not resolve on this node "
                                  f"({exc.strerror}); export the head node's address", every_rank=True) from None
        except OSError as exc:
            last = exc.strerror or type(exc).__name__
        time.sleep(min(0.25, max(_remaining(deadline), 0)))


def _open_store(world: World, addr: str, port: int, deadline: float, wait: float):
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent already serves a store at MASTER_PORT: every rank is a client, and keys live
        # under this restart's prefix (torch's env:// rendezvous does the same), so a restart sees no stale ones
        _wait_for_master(addr, port, deadline, world, wait)
        base = dist.TCPStore(addr, port, world.size, is_master=False,
                             timeout=timedelta(seconds=max(_remaining(deadline), 1.0)))
        return dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)
    if world.size == 1:  # nobody to meet: an in-memory store, no socket
        return dist.HashStore()
    if world.rank == 0:
        try:
            # wait_for_workers=False: the wait for the workers happens below, in Python, under our deadline
            return dist.TCPStore(addr, port, world.size, is_master=True, timeout=timedelta(seconds=wait),
                                 wait_for_workers=False, master_listen_fd=_socket_at(addr, port))
        except (RuntimeError, OSError) as exc:
            raise RendezvousError(f"rendezvous failed: rank 0 cannot listen on port {port} "
                                  f"({_first_line(exc)}); another job or process holds it: pick another "
                                  f"MASTER_PORT", every_rank=True) from None
    _wait_for_master(addr, port, deadline, world, wait)
    try:
        return dist.TCPStore(addr, port, world.size, is_master=False,
                             timeout=timedelta(seconds=max(_remaining(deadline), 1.0)))
    except (RuntimeError, OSError) as exc:
        raise RendezvousError(f"rendezvous failed: rank {world.rank} reached {addr}:{port} but could not join the "
                              f"store there ({_first_line(exc)}); is MASTER_PORT another service's port?",
                              every_rank=True) from None


def _socket_at(addr: str, port: int) -> Optional[int]:
    """A socket bound to ``addr:port`` for the store to listen on (its file descriptor; TCPStore takes it
    over), so that the store is reachable where MASTER_ADDR says and not on every interface. None when
    ``addr`` is not an address of this node (a name behind NAT, say): then torch listens on every
    interface, as it does by itself. A port already taken raises OSError (the caller names it)."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    for family, kind, proto, _name, where in sorted(infos, key=lambda i: i[0] != socket.AF_INET):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server socket
            sock.bind(where)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise
            continue
        return sock.detach()
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def record(world: World, addr: str) -> dict:
    import torch

    from .. import __version__
    from .head import source_address

    return {"rank": world.rank, "host": socket.gethostname(), "addr": source_address(addr) or "",
            "job": os.environ.get("SLURM_JOB_ID"), "code": code_fingerprint(), "megafixed": __version__,
            "torch": torch.__version__, "pid": os.getpid()}


def meet(world: World, addr: str, port: int, wait: Optional[float] = None):
    """Meet every rank; returns the TCPStore. Raises RendezvousError naming what is missing."""
    global _STORE, _PEERS
    wait = rdzv_timeout() if wait is None else wait
    deadline = time.monotonic() + wait
    with signals_end_the_rendezvous(world.rank, world.size):
        if world.local_rank == 0 and world.size > 1:  # one line per node says where a hung start waits
            print(f"megafixed: rank {world.rank} of {world.size} on {socket.gethostname()}: rendezvous at "
                  f"{addr}:{port} "
                  f"(waits up to {wait:g}s, MEGAFIXED_RDZV_TIMEOUT)", file=sys.stderr, flush=True)
        store = _open_store(world, addr, port, deadline, wait)
        mine = record(world, addr)
        try:
            store.set(f"{PREFIX}/rank/{world.rank}", json.dumps(mine))
            arrived = store.add(f"{PREFIX}/arrived", 1)
            while arrived < world.size and _remaining(deadline) > 0:
                time.sleep(0.2)
                arrived = store.add(f"{PREFIX}/arrived", 0)
        except (RuntimeError, OSError) as exc:  # the master went away while we waited
            raise RendezvousError(f"rendezvous failed: rank {world.rank} lost the master at {addr}:{port} while "
                                  f"waiting for the others ({_first_line(exc)}); see rank 0's log") from None
        if arrived < world.size:
            raise RendezvousError(_missing_message(store, world, wait, f"{addr}:{port}"))
        records = [json.loads(v) for v in store.multi_get([f"{PREFIX}/rank/{r}" for r in range(world.size)])]
        store.add(f"{PREFIX}/read", 1)
    # Outside the block above: a TERM while the verdict waits for rank 0 must end this rank with the
    # verdict's own code, not the 143 of "TERM during the rendezvous" (srun reports the highest code).
    _check_same_code(records, world.rank, everyone_read=lambda: store.add(f"{PREFIX}/read", 0) >= world.size)
    _STORE, _PEERS = store, records
    return store


def _missing_message(store, world: World, wait: float, master: str) -> str:
    came = {}
    for r in range(world.size):
        if store.check([f"{PREFIX}/rank/{r}"]):
            came[r] = json.loads(store.get(f"{PREFIX}/rank/{r}")).get("host", "?")
    missing = [r for r in range(world.size) if r not in came]
    layout = slurm_task_nodes(world.size)
    where = ""
    if layout:
        nodes = list(dict.fromkeys(layout[r] for r in missing))
        where = f" on node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)} (Slurm's task layout)"
    hosts = sorted(set(came.values()))
    hint = ("their task never started (check that node's slurmd log and the job's output)" if where else
            "they were never launched, or were given another MASTER_ADDR/MASTER_PORT")
    return (f"rendezvous timed out after {wait:g}s at MASTER_ADDR={master}: {len(missing)} of {world.size} ranks "
            f"never arrived: rank{'s' if len(missing) > 1 else ''} {ranges(missing)}{where}; arrived: ranks "
            f"{ranges(sorted(came))} on {', '.join(hosts)}. Probably {hint}; every rank needs the same "
            f"MASTER_ADDR/MASTER_PORT (MEGAFIXED_RDZV_TIMEOUT sets the wait)")


def slurm_task_nodes(size: int) -> list[str]:
    """Node of each rank under Slurm's block distribution (``SLURM_JOB_NODELIST`` x ``SLURM_TASKS_PER_NODE``,
    e.g. ``2(x2)``), or [] when not under Slurm or the layout does not cover ``size`` ranks."""
    nodelist, per_node = os.environ.get("SLURM_JOB_NODELIST"), os.environ.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not per_node:
        return []
    from .head import expand_nodelist

    counts: list[int] = []
    try:
        for part in per_node.split(","):
            n, _, rep = part.partition("(x")
            counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
        hosts = expand_nodelist(nodelist)
    except (ValueError, LaunchError):
        return []
    out = [h for h, n in zip(hosts, counts) for _ in range(n)]
    return out if len(out) == size else []


def _check_same_code(records: list[dict], rank: int = 0, everyone_read=lambda: True) -> None:
    """Refuse ranks that run different code. The verdict's exit code must be the job's: under srun,
    which reports the highest task code, a rank that srun ends while still polling the rendezvous
    (143) would hide rank 0's 2. So rank 0 refuses only once every rank has read the records
    (``everyone_read``, bounded), when each is in its own verdict, which keeps the code on a TERM."""
    groups: dict = {}
    for rec in records:
        groups.setdefault((rec["megafixed"], rec["code"], rec["torch"]), []).append(rec)
    if len(groups) <= 1:
        return
    seen = "; ".join(f"ranks {ranges([r['rank'] for r in recs])} on {', '.join(sorted({r['host'] for r in recs}))}: "
                     f"megafixed {key[0]} code {key[1]}, torch {key[2]}" for key, recs in groups.items())
    base = next(key for key, recs in groups.items() if any(r["rank"] == 0 for r in recs))
    odd = sorted({r["host"] for key, recs in groups.items() if key != base for r in recs})
    head = sorted({r["host"] for r in groups[base]})
    runs = "runs" if len(odd) == 1 else "run"
    error = RendezvousError(f"the ranks run different code ({seen}); {', '.join(odd)} {runs} "
                            f"other code than rank 0 ({', '.join(head)}): install the same megafixed revision and "
                            f"torch on every node (one shared checkout or venv, or one container image) and resubmit")
    if rank == 0:
        deadline = time.monotonic() + 5.0  # the others poll every 0.2 s: they read within moments
        while time.monotonic() < deadline and not _safely(everyone_read):
            time.sleep(0.05)
    else:
        # Every rank reaches this verdict, but only rank 0 prints it. A rank that left first would have
        # srun (--kill-on-bad-exit) kill rank 0 before its line is out: give rank 0 the lead (bounded).
        _wait_for_rank0_to_print(error)
    raise error


def _safely(check) -> bool:
    try:
        return bool(check())
    except (RuntimeError, OSError):  # the store went away: nobody is left to wait for
        return True


def _wait_for_rank0_to_print(error: BaseException, seconds: float = 3.0) -> None:
    """Sleep up to ``seconds``; the launcher's TERM (rank 0 has printed and exited) ends this rank at once
    with the verdict's own exit code, so the job's code is the refusal's whichever rank srun saw last."""
    from ..errors import describe
    from .refusal import term_exits_with

    with term_exits_with((describe(error) or (2, ""))[0]):
        time.sleep(seconds)


def init_process_group(world: World, backend: str, collective_timeout_s: float = 600, device_id=None) -> None:
    """The rendezvous (``meet``), then ``torch.distributed.init_process_group`` on its store.

    ``collective_timeout_s`` bounds every collective of every group afterwards -- the default group
    and the groups megatron-core and DeepSpeed create, which would otherwise get torch's 30 minutes
    -- so a rank whose peer died mid-step fails after that long instead of hanging. ``device_id`` (NCCL):
    this rank's GPU, bound to the group at once (torch then connects NCCL eagerly on that device and never
    guesses the device from the rank)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world.size == 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # a lone process meets nobody: an in-memory store (_open_store), no port; gloo's own listener
        # (gloo opens one per group, even for one rank) on loopback unless an interface was chosen
        addr, port = addr or "127.0.0.1", port or "0"
        if backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
            from .head import interface_of

            loopback = interface_of("127.0.0.1")
            if loopback:
                os.environ["GLOO_SOCKET_IFNAME"] = loopback
    try:
        port_n = int(port)
    except (TypeError, ValueError):
        raise LaunchError(f"MASTER_PORT={port!r} is not a port number") from None
    from . import warnings_once

    warnings_once.install(world.rank, world.size)  # a warning every rank raises: printed once, by rank 0
    store = meet(world, addr, port_n)
    warnings_once.attach(store)
    if backend == "gloo" and world.size > 1:
        from .head import pin_gloo_interface

        name = pin_gloo_interface(addr)
        if name and world.local_rank == 0:
            print(f"megafixed: {socket.gethostname()} resolves to loopback; gloo uses {name} (GLOO_SOCKET_IFNAME), "
                  f"the interface towards the master {addr}", file=sys.stderr, flush=True)
    timeout = timedelta(seconds=collective_timeout_s)
    # new_group(timeout=None) reads these module globals at call time; DeepSpeed's and megatron's groups
    # pass no timeout, and torch offers no public default to set.
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout
    store.set_timeout(timeout)
    with signals_end_the_rendezvous(world.rank, world.size):
        dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", store), rank=world.rank,
                                world_size=world.size, timeout=timeout, device_id=device_id)
    if world.size > 1:
        start_heartbeat(store, world.rank)


def heartbeat_key(rank: int) -> str:
    return f"{PREFIX}/heartbeat/{rank}"


def start_heartbeat(store, rank: int) -> None:
    """A daemon thread bumping this rank's counter every HEARTBEAT_S. A rank stuck in a collective still
    beats (collectives release the GIL); a dead or cut-off rank stops: that is how survivors tell them apart.
    One tiny store write per rank and second: nothing next to a training step."""
    def beat():
        n = 0
        while True:
            n += 1
            try:
                store.set(heartbeat_key(rank), str(n))
            except Exception:  # noqa: BLE001 -- the store (rank 0) is gone: nothing left to tell
                return
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, name="megafixed-heartbeat", daemon=True).start()
