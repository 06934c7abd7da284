"""CPU threads for every verb that computes: one decision, in this one place, printed once.

torch's default (one intra-op thread per core, OpenMP threads that spin while they wait) is fast on an
idle machine and collapses on a busy one: every parallel region waits for its slowest thread, and a
spinning thread burns the core the straggler needs. A new user's quickstart on a loaded 2-core box ran
at 0.1k tokens/s this way, against 2-4k with one thread (docs/benchmarks.md, "CPU threads").

The policy, in order:

1. ``train.threads`` (the config) or a verb's ``--threads``, when given;
2. ``OMP_NUM_THREADS`` when set (torchrun sets 1 for multi-process runs, Slurm scripts often set it);
3. otherwise this process's share of the cores it may run on: usable cores (the affinity mask, which
   Slurm and taskset restrict) divided by the processes of this job on the node (``LOCAL_WORLD_SIZE``).

In every case OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``, unless the user set it): a
waiting thread sleeps instead of spinning, which is what keeps several threads robust under load.
libgomp reads that variable once, when torch loads it, so ``set_wait_policy`` must run before torch
is imported: ``megafixed.cli`` calls it first thing (the package's ``__init__`` imports no torch).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

WAIT_POLICY = "PASSIVE"
_announced: tuple | None = None


def set_wait_policy(environ=os.environ) -> None:
    """Before torch loads OpenMP: passive waits, unless the user chose otherwise."""
    environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    source: str  # why this number, for the printed line

    def line(self, knob: str = "train.threads=N or OMP_NUM_THREADS=N") -> str:
        policy = os.environ.get("OMP_WAIT_POLICY") or "libgomp's default"
        return (f"cpu threads: {self.threads} intra-op ({self.source}; OpenMP wait policy {policy.lower()}); "
                f"set {knob} to change")


def decide(requested: int | None = None, environ=os.environ) -> ThreadChoice:
    if requested:
        return ThreadChoice(int(requested), "asked for")
    env = environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return ThreadChoice(int(env), "OMP_NUM_THREADS")
    cores = usable_cores()
    local = environ.get("LOCAL_WORLD_SIZE", "").strip()
    procs = int(local) if local.isdigit() and int(local) > 0 else 1
    share = max(1, cores // procs)
    per = f"{cores} usable cores / {procs} processes on this node" if procs > 1 else f"{cores} usable cores"
    return ThreadChoice(share, f"default: {per}")


def apply_thread_policy(requested: int | None = None, *, log=print, announce: bool = True,
                        knob: str = "train.threads=N or OMP_NUM_THREADS=N") -> ThreadChoice:
    """Set torch's intra-op threads by the policy above; print the choice the first time (and again only
    if a later call in the same process changes it)."""
    global _announced
    import torch

    choice = decide(requested)
    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    key = (choice.threads, choice.source)
    if announce and _announced != key:
        log(choice.line(knob))
        sys.stdout.flush()
    if announce:
        _announced = key
    return choice
