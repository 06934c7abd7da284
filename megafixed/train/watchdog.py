"""The hang watchdog (NVRx's in-job hang detection, torchtitan's flight-recorder dump on a timeout):
when no step completes within ``watchdog.timeout_s``, every live rank writes the Python stacks of
all its threads to ``<run_dir>/faults/``, rank 0 names in one line the ranks (and hosts) that never
reached the step, and the job exits ``exit_codes.HUNG``, which the Slurm job script requeues.

A thread per rank, beside the heartbeat (``launch/rendezvous.py``): the main thread only stores two
integers per step (the step it entered, the step it finished); the thread publishes them on the
rendezvous store once a second, which outlives a stuck collective, so the ranks that did not reach
the step can be told from those waiting in its collectives. The first rank to time out raises a
flag on the store; the others see it within a poll and dump their stacks too.

The timeout: ``watchdog.timeout_s``, or 0 (auto) = max(300 s, 20 x the median of the last steps).
Checkpoint saves and validation passes (``grace``) get at least ``parallel.collective_timeout_s``: those
are slow by nature, and a peer lost inside them is already named by the collective timeout
(``launch/lost.py``). The first step (compilation, the first collectives' set-up) gets nearly as long,
but ends ``NAME_AHEAD_S`` before the collective timeout: a rank hung before its first step leaves the
others waiting in its first collective, which gloo / NCCL end after exactly that timeout, and the
hang must be named (stacks dumped, ranks named) before they do -- at the same deadline the two would
race and the line could be missing (on a requeued job's first step, where nothing else has run yet).

The line names the stack files that were written (each rank reports its file's path on the store).
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Optional

from .. import exit_codes
from .flight_recorder import dump_flight_recorder

AUTO_FLOOR_S = 300.0
AUTO_FACTOR = 20.0
POLL_S = 0.5
PUBLISH_S = 1.0
GATHER_S = 10.0  # how long rank 0 waits for the other ranks' stack files before naming and exiting
NAME_AHEAD_S = 10.0  # the first step's allowance ends this long before the collective timeout (at most 1/4 of it)
KEY = "megafixed/hang"


def _key(what: str, rank: int) -> str:
    return f"{KEY}/{what}/{rank}"


class HangWatchdog:
    def __init__(self, *, timeout_s: float, slow_phase_s: float, faults_dir: Path, rank: int, world: int,
                 say=print, store=None, hosts: Optional[list] = None, done: int = 0):
        """``done``: the steps done before this run started (a resumed run's first step is ``done + 1``)."""
        self.fixed = float(timeout_s) if timeout_s and timeout_s > 0 else None
        self.slow_phase_s = float(slow_phase_s)
        self.faults_dir, self.rank, self.world, self.say = Path(faults_dir), rank, world, say
        self.store = store if world > 1 else None
        self.hosts = hosts or [socket.gethostname()] * world
        self.entered = self.finished = self.done = done  # log step numbers, written by the main thread only
        self.recent: deque = deque(maxlen=50)
        self.first_from = time.monotonic()  # when the first step's allowance began (``start`` sets it again)
        self.deadline = self.first_from + self.first_step_s()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._dumped: Optional[Path] = None  # this rank's stack file, once written

    @classmethod
    def for_run(cls, timeout_s: float, slow_phase_s: float, topo, faults_dir: Path, say, done: int = 0
                ) -> "HangWatchdog":
        """Started at the first step (``start``): ``watchdog.timeout_s``, ``parallel.collective_timeout_s``."""
        from ..launch import rendezvous

        hosts = [p["host"] for p in sorted(rendezvous.peers(), key=lambda p: p["rank"])] or None
        return cls(timeout_s=timeout_s, slow_phase_s=slow_phase_s,
                   faults_dir=faults_dir, rank=topo.rank, world=topo.world_size, say=say,
                   store=rendezvous.store(), hosts=hosts if hosts and len(hosts) == topo.world_size else None,
                   done=done)

    def timeout(self) -> float:
        if self.fixed is not None:
            return self.fixed
        if not self.recent:
            return AUTO_FLOOR_S
        return max(AUTO_FLOOR_S, AUTO_FACTOR * statistics.median(self.recent))

    def first_step_s(self) -> float:
        """The first step's allowance: as long as the collective timeout allows, and ahead of it."""
        return max(self.timeout(), self.slow_phase_s - self._ahead())

    def _ahead(self) -> float:
        return min(NAME_AHEAD_S, self.slow_phase_s / 4)

    def gather_until(self) -> float:
        """When rank 0 stops waiting for the other ranks' stack files and names the hang. In the first step the
        others sit in a collective that gloo / NCCL end ``parallel.collective_timeout_s`` after it began, so the
        wait ends halfway through the margin left before that: a rank that cannot answer (SIGSTOP) must not
        push the line past the collective timeout. Later, ``GATHER_S``."""
        later = time.monotonic() + GATHER_S
        if self.finished > self.done or self.fixed is not None and self.fixed >= self.slow_phase_s:
            return later
        return min(later, self.first_from + self.slow_phase_s - self._ahead() / 2)

    # ---- the main thread
    def start(self) -> "HangWatchdog":
        """Once, at the first step (the first step's allowance counts from here)."""
        if self._thread is not None:
            return self
        self.first_from = time.monotonic()
        self.deadline = self.first_from + self.first_step_s()
        self._thread = threading.Thread(target=self._watch, name="megafixed-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def enter(self, step: int) -> None:
        self.entered = step

    @contextlib.contextmanager
    def step(self, step: int):
        """Around one computation of (log) step ``step``: entered, then finished (its time counts)."""
        self.enter(step)
        t0 = time.perf_counter()
        yield
        self.finish(step, time.perf_counter() - t0)

    def finish(self, step: int, seconds: float) -> None:
        self.finished = step
        self.recent.append(seconds)
        self.deadline = time.monotonic() + self.timeout()

    def touch(self, step: int) -> None:
        """Progress without a timed step (a skipped step's batches consumed)."""
        self.entered = self.finished = step
        self.deadline = time.monotonic() + self.timeout()

    def slow_phase(self) -> None:
        """From now to ``pace``: a save or a validation pass, given at least ``parallel.collective_timeout_s``."""
        self.deadline = time.monotonic() + max(self.timeout(), self.slow_phase_s)

    def pace(self) -> None:
        """A full timeout for the step about to begin (the first one keeps its own allowance from ``start``)."""
        if self.finished > self.done:
            self.deadline = time.monotonic() + self.timeout()

    @contextlib.contextmanager
    def grace(self):
        """Around a save or a validation pass: at least ``parallel.collective_timeout_s`` for it, and a
        full timeout for the step after it."""
        self.deadline = time.monotonic() + max(self.timeout(), self.slow_phase_s)
        try:
            yield
        finally:
            self.deadline = time.monotonic() + self.timeout()

    def stop(self) -> None:
        self._stop.set()

    # ---- the watchdog thread
    def _watch(self) -> None:
        published, last_publish = None, 0.0
        while not self._stop.wait(POLL_S):
            now = time.monotonic()
            if self.store is not None and now - last_publish >= PUBLISH_S:
                state = (self.entered, self.finished)
                with contextlib.suppress(Exception):  # the store (rank 0) gone: the lost-peer path names it
                    if state != published:
                        self.store.set(_key("progress", self.rank), f"{state[0]} {state[1]}")
                        published = state
                    if self.store.check([KEY]):
                        return self._fire(noticed=False)
                last_publish = now
            if now > self.deadline:
                return self._fire(noticed=True)

    def _fire(self, noticed: bool) -> None:
        if self._stop.is_set():
            return
        if noticed and self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(KEY, str(self.rank))
        path = self._dump_stacks()
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(_key("progress", self.rank), f"{self.entered} {self.finished}")
                self.store.set(_key("dumped", self.rank), str(path))
        if self.rank == 0:
            self._name_the_ranks()
            time.sleep(1.0)  # the others leave first, each with HUNG: a launcher then sees 76, not its own kill
        else:
            self._wait_for(lambda: self.store is None or self.store.check([_key("named", 0)]))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_codes.HUNG)

    def _dump_stacks(self) -> Path:
        self.faults_dir.mkdir(parents=True, exist_ok=True)
        step = self.finished + 1
        path = self.faults_dir / f"hang.step{step:08d}.rank{self.rank:05d}.{self.hosts[self.rank]}.txt"
        self._dumped = path
        with open(path, "w") as f:
            f.write(f"# rank {self.rank} of {self.world} on {self.hosts[self.rank]}, pid {os.getpid()}: no step "
                    f"completed within {self.timeout():g}s after step {self.finished}; this rank entered step "
                    f"{self.entered}. Python stacks of every thread:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        # after the stacks: they are written even if this fails
        recorder = dump_flight_recorder(self.faults_dir / f"nccl_trace.step{step:08d}", self.rank)
        if recorder is not None:
            with open(path, "a") as f:
                f.write(f"# NCCL's flight recorder of this rank: {recorder} (every rank's: python -m "
                        f"torch.distributed.flight_recorder.fr_trace {recorder.parent} -p rank_)\n")
        return path

    def _wait_for(self, done) -> None:
        deadline = self.gather_until()
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if done():
                    return
            time.sleep(0.1)

    def _progress(self) -> dict:
        if self.store is None:
            return {0: (self.entered, self.finished)}
        keys = [_key("progress", r) for r in range(self.world)]
        self._wait_for(lambda: self.store.check([_key("dumped", r) for r in range(self.world)]))
        out = {}
        for r, k in enumerate(keys):
            with contextlib.suppress(Exception):
                if self.store.check([k]):
                    a, b = self.store.get(k).decode().split()
                    out[r] = (int(a), int(b))
        return out

    def _stack_files(self) -> str:
        """Where the stacks are, as the ranks reported their files: one pattern when they share it."""
        paths = {self.rank: self._dumped}
        if self.store is not None:
            for r in range(self.world):
                with contextlib.suppress(Exception):
                    if self.store.check([_key("dumped", r)]):
                        paths[r] = Path(self.store.get(_key("dumped", r)).decode())
        missing = [r for r in range(self.world) if r not in paths]
        names = {p.name.split(".rank")[0] for p in paths.values()}
        where = (f"Python stacks of {'every rank' if not missing else f'{len(paths)} of {self.world} ranks'} in "
                 + (f"{self.faults_dir}/{names.pop()}.rank*.txt" if len(names) == 1 else
                    ", ".join(str(paths[r]) for r in sorted(paths))))
        if missing:
            from ..launch.world import ranges

            where += f" (none from rank{'s' if len(missing) > 1 else ''} {ranges(missing)})"
        return where

    def _name_the_ranks(self) -> None:
        from ..launch.world import ranges

        progress = self._progress()
        files = self._stack_files()
        step = max((p[0] for p in progress.values()), default=self.entered)
        behind = [r for r in range(self.world) if progress.get(r, (0, 0))[0] < step]
        where = sorted({self.hosts[r] for r in behind})
        if behind:
            who = (f"rank{'s' if len(behind) > 1 else ''} {ranges(behind)} on {', '.join(where)} never reached step "
                   f"{step} (the others wait in its collectives)")
        else:
            who = f"every rank entered step {step} and none finished it (a collective or the device is stuck)"
        self.say(f"hang: no step completed within {self.timeout():g}s (watchdog.timeout_s) after step "
                 f"{min((p[1] for p in progress.values()), default=self.finished)}: {who}; {files}; exit "
                 f"{exit_codes.HUNG} (a Slurm job requeues itself)")
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(_key("named", 0), "1")
