"""One writer per run directory: an advisory lock file held for a trainer's whole life.

Why a lock *file* created with ``O_CREAT | O_EXCL`` and not ``flock``/``fcntl``: run directories
live on shared filesystems (NFS, Lustre, GPFS, BeeGFS) where ``flock`` is per-node on some mounts,
silently local on others, or simply ENOLCK; exclusive creation is atomic on all of them (NFSv3+,
Lustre, GPFS) and leaves a file a person can read. What we rely on:

* **Taking it**: ``open(LOCK, O_CREAT|O_EXCL)``; the file holds ``{"host", "pid", "start", "since"}``
  (``start``: the holder process's start time from ``/proc``, so a reused pid is not mistaken for
  the holder).
* **Releasing it**: on any exit that runs Python (normal end, exception, Ctrl-C, SIGTERM stop) the
  ``with`` block removes the file -- only if it is still ours.
* **Stale after the holder is gone**: on the *same host* the holder is alive iff its pid exists with
  the same start time (checked at once, no waiting). From *another host* we cannot see the process,
  so the holder refreshes the file's mtime every ``HEARTBEAT_S`` from a daemon thread, and a lock
  whose mtime is older than ``STALE_S`` is stale (this assumes clocks agree to within minutes,
  as NTP keeps them; the mtime is set by the file server). A kill -9'd trainer on another node
  therefore blocks its run directory for up to ``STALE_S``; the refusal says so and names the file
  to delete by hand.
* **Under Slurm** the record also names the job and the node (``SLURM_JOB_ID``, ``SLURM_RESTART_COUNT``,
  ``SLURMD_NODENAME``): Slurm runs one incarnation of a job at a time, so a lock left by an earlier
  incarnation of *this* job (a requeue after a hard kill, possibly on another node) is stale at once; so is
  one of this job whose node is not among the job's nodes now (``SLURM_JOB_NODELIST``, expanded by
  ``scontrol show hostnames``: a lost head node the job went on without), since a job's processes run only
  on its own nodes; and one held by another job is stale as soon as ``squeue`` no longer lists that job as
  running -- no 10-minute wait on a cluster. A lock of this job on one of its live nodes is respected.
* **Breaking a stale lock** renames it to a unique name first (atomic: of two processes that both
  judged it stale only one rename succeeds on the same file), re-reads what was renamed and puts
  it back if it was not the stale holder after all.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Optional

from ..trust.errors import UntrustedRunDirectory
from .checkpoint_error import CheckpointError

HEARTBEAT_S = 60.0
STALE_S = 600.0
# A lock file that exists but is still empty/half-written (its creator is between open and write)
# is given this long before it counts as stale.
EMPTY_GRACE_S = 30.0


class RunDirectoryBusy(CheckpointError):
    """Another trainer holds the run directory."""


def _proc_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _alive(pid: int, start: Optional[str]) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    now = _proc_start(pid)
    return start is None or now is None or now == start


def _slurm_job() -> dict:
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return {}
    return {"slurm_job_id": job, "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
            "slurm_node": os.environ.get("SLURMD_NODENAME")}


def _slurm_job_nodes() -> Optional[list[str]]:
    """This job's nodes (``SLURM_JOB_NODELIST`` expanded by Slurm itself), or None where that cannot be told.
    (``launch/head.py`` expands node lists for the rendezvous; run/ sits beneath launch/, hence its own call.)"""
    import shutil
    import subprocess

    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist or shutil.which("scontrol") is None:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.split() if out.returncode == 0 and out.stdout.split() else None


def _node_gone(held: dict) -> Optional[str]:
    """Why the node of ``held`` (a lock of this job) cannot run its holder: it is not one of the job's nodes."""
    nodes = _slurm_job_nodes()
    node = held.get("slurm_node") or held.get("host")
    if not nodes or not node:
        return None
    short = {n.split(".")[0] for n in nodes}  # a record from before slurm_node has the hostname, maybe qualified
    if node in nodes or node.split(".")[0] in short:
        return None
    return f"its node {node} is not one of Slurm job {held['slurm_job_id']}'s nodes ({', '.join(nodes)})"


def _slurm_job_running(job: str) -> Optional[bool]:
    """Whether Slurm lists ``job`` as running/suspended (None: squeue is not available here)."""
    import shutil
    import subprocess

    if shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return False if "Invalid job id" in out.stderr else None  # long gone from the controller's memory
    return any(state.strip() in ("RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "STOPPED")
               for state in out.stdout.splitlines())


def holder_text(info: dict) -> str:
    job = f", Slurm job {info['slurm_job_id']}" if info.get("slurm_job_id") else ""
    return f"host {info.get('host', '?')}, pid {info.get('pid', '?')}{job}, since {info.get('since', '?')}"


class RunLock:
    """``with RunLock(path): ...`` -- raise ``RunDirectoryBusy`` naming the holder if it is taken."""

    def __init__(self, path, heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S):
        self.path = Path(path)
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self.info: Optional[dict] = None
        # The stale lock this one replaced, and why it was stale (for the trainer's one line), else None.
        self.took_over: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- taking and releasing
    def acquire(self) -> "RunLock":
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start": _proc_start(os.getpid()),
              "since": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), **_slurm_job()}
        for _ in range(3):  # a stale lock broken in between: try again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                held = self._read()
                why_stale = self._stale(held)
                if why_stale is None:
                    raise RunDirectoryBusy(self._busy_message(held)) from None
                self._break(held)
                if held:
                    self.took_over = f"{holder_text(held)}: {why_stale}"
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(me) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            self.info = me
            self._start_heartbeat()
            return self
        raise RunDirectoryBusy(f"could not take the run directory lock {self.path}: other processes keep "
                               f"replacing it; make sure only one trainer uses this train.run_dir")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.info is not None and self._read() == self.info:  # never remove another's lock
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.info = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # ---- the holder
    def _read(self) -> Optional[dict]:
        """The holder's record; None if the file is gone; {} if it is empty or unreadable."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError:
            return {}
        try:
            info = json.loads(text)
        except ValueError:
            return {}
        return info if isinstance(info, dict) else {}

    def _age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return float("inf")

    def _stale(self, held: Optional[dict]) -> Optional[str]:
        """Why the lock ``held`` no longer protects anything (None: it is live)."""
        if held is None:
            return "gone"
        if not held:
            return "empty" if self._age() > EMPTY_GRACE_S else None
        job = held.get("slurm_job_id")
        if job:
            mine = _slurm_job()
            earlier = int(held.get("slurm_restart", 0)) < int(mine.get("slurm_restart", 0))
            if mine.get("slurm_job_id") == job and earlier:
                return f"left by an earlier run of Slurm job {job}"
            if mine.get("slurm_job_id") == job and held.get("host") != socket.gethostname():
                gone = _node_gone(held)
                if gone:
                    return gone
            if mine.get("slurm_job_id") != job and _slurm_job_running(job) is False:
                return f"Slurm job {job} is no longer running"
        if held.get("host") == socket.gethostname():
            pid = held.get("pid")
            if isinstance(pid, int) and not _alive(pid, held.get("start")):
                return f"pid {pid} is not running"
            return None
        age = self._age()
        return f"no heartbeat for {age:.0f}s" if age > self.stale_s else None

    def _break(self, held: Optional[dict]) -> None:
        if held is None:
            return
        aside = self.path.with_name(f"{self.path.name}.stale.{socket.gethostname()}.{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # someone else broke it
        try:
            taken = json.loads(aside.read_text())
        except (OSError, ValueError):
            taken = {}
        if taken != held and taken:  # a fresh lock appeared in between: give it back
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
        with contextlib.suppress(OSError):
            aside.unlink()

    def _busy_message(self, held: dict) -> str:
        where = self.path.parent
        same_host = held.get("host") == socket.gethostname()
        how = ("stop it first or use another train.run_dir" if same_host else
               f"stop it first or use another train.run_dir (if it died without cleaning up, the lock goes stale "
               f"{self.stale_s / 60:.0f} minutes after its last heartbeat, or delete {self.path})")
        who = holder_text(held) if held else f"a process that is just starting (lock file {self.path})"
        return f"run directory {where} is in use by another trainer ({who}); {how}"

    # ---- heartbeat for holders on other hosts
    def _start_heartbeat(self) -> None:
        self._stop.clear()

        def beat() -> None:
            while not self._stop.wait(self.heartbeat_s):
                with contextlib.suppress(OSError):
                    os.utime(self.path)

        self._thread = threading.Thread(target=beat, name="megafixed-run-lock-heartbeat", daemon=True)
        self._thread.start()


def _make_dirs(path: Path) -> list[Path]:
    """``mkdir -p path``; returns the directories it created, deepest last."""
    made, p = [], Path(path)
    while not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    Path(path).mkdir(parents=True, exist_ok=True)
    return made[::-1]


def _remove_if_empty(dirs: list[Path]) -> None:
    for d in reversed(dirs):
        with contextlib.suppress(OSError):
            d.rmdir()  # only if empty: never anything of another writer's


@contextlib.contextmanager
def hold_run_dir(rd, is_main: bool):
    """The trainer's lock for its whole life: rank 0 takes ``<run_dir>/.megafixed.lock`` (creating
    the directory if needed, and removing it again at the end if nothing was written into it) and
    every rank learns whether it got it, so a refused start ends on every rank with the same line.
    ``rd``: the run's ``RunDirectory``."""
    lock, refusal, made = rd.lock(), None, []
    untrusted = False
    if is_main:
        try:
            rd.check_trusted()  # an existing one: before anything in it is read or written
        except UntrustedRunDirectory as exc:
            refusal, untrusted = str(exc), True
    if is_main and refusal is None:
        made = _make_dirs(rd.path)
        try:
            lock.acquire()
        except RunDirectoryBusy as exc:
            refusal = str(exc)
            _remove_if_empty(made)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [refusal, untrusted]
        dist.broadcast_object_list(box, src=0)
        refusal, untrusted = box
    if refusal:
        raise (UntrustedRunDirectory if untrusted else RunDirectoryBusy)(refusal)
    try:
        yield lock
    finally:
        lock.release()
        _remove_if_empty(made)  # a run that failed before writing anything leaves no directory behind
