"""Profiler traces and CUDA memory snapshots of a window of steps (torchtitan's ``profiling`` section,
Megatron's ``--profile`` / ``--record-memory-history``).

``profile.steps=10-12``: ``torch.profiler`` records steps 10 to 12 (as numbered in the logs) on every rank
and writes one Chrome trace per rank, ``<run_dir>/profile/rank{R}_steps10-12.json`` (Perfetto and
chrome://tracing open it); each step is a ``ProfilerStep#N`` range in it. Rank 0 then says one line: the
top operators by self time (device time on CUDA, CPU time otherwise) and the share of the steps' wall
time during which communication was in flight. ``profile.memory_snapshot=true`` records every CUDA
allocation over the same window and dumps ``rank{R}_memory.pickle`` (https://pytorch.org/memory_viz reads
it); without CUDA it says so in one line and the run goes on. An existing output is never replaced: a
second profile of the same window (a resumed run) gets ``.2``, ``.3``, ... before its extension.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ...config import ProfileConfig  # the section lives in config.py: the config package sits beneath train
from .base import Callback

# Operators that are communication: c10d's ops, the backends' own ranges and kernels, DeepSpeed's comm ops.
COMM_MARKERS = ("c10d", "gloo", "nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                "_reduce_scatter", "broadcast", "all_to_all", "alltoall", "send", "recv", "barrier")


def _is_comm(name: str) -> bool:
    low = name.lower()
    return any(m in low for m in COMM_MARKERS)


def free_path(folder: Path, stem: str, suffix: str) -> Path:
    """``folder/stem+suffix``, or ``stem.2+suffix``, ``stem.3+suffix``...: the first that does not exist."""
    path, n = folder / f"{stem}{suffix}", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}.{n}{suffix}"
    return path


def summarize(prof, top: int, device: bool) -> dict:
    """The top operators by self time (``key_averages``: device time on CUDA, else CPU time) and the share
    of the profiled wall time (first step's start to last step's end) during which communication was in
    flight on any thread or stream: gloo works on its own threads and NCCL on its own kernels, so the
    training thread's own time in collectives would understate it."""
    attr = "self_device_time_total" if device else "self_cpu_time_total"
    times = [(e.key, float(getattr(e, attr, 0.0) or 0.0)) for e in prof.key_averages()]
    times = [(k, t) for k, t in times if t > 0]
    total = sum(t for _, t in times)
    ops = sorted(((k, t) for k, t in times if not k.startswith("ProfilerStep")), key=lambda kt: -kt[1])
    events = prof.events()
    steps = [e.time_range for e in events if e.name.startswith("ProfilerStep")]  # "ProfilerStep*" here
    lo, hi = (min(r.start for r in steps), max(r.end for r in steps)) if steps else (0, 0)
    comm = [(max(lo, e.time_range.start), min(hi, e.time_range.end)) for e in events if _is_comm(e.name)]
    return {"clock": "device" if device else "cpu", "total_us": total,
            "top": [{"name": k, "self_us": t, "share": t / total if total else 0.0} for k, t in ops[:top]],
            "comm_share": covered(comm) / (hi - lo) if hi > lo else 0.0}


def covered(intervals) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, None
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if reach is None or a > reach:
            total, reach = total + b - a, b
        elif b > reach:
            total, reach = total + b - reach, b
    return total


def summary_line(first: int, last: int, folder: Path, trace_name: str, stats: dict, world: int) -> str:
    ops = ", ".join(f"{o['name']} {o['share']:.0%}" for o in stats["top"]) or "none recorded"
    traces = f"{folder}/rank*_steps{first}-{last}*.json ({world} ranks)" if world > 1 else f"{folder}/{trace_name}"
    return (f"profile of steps {first}-{last}: top operators by self {stats['clock']} time on rank 0: {ops}; "
            f"communication in flight {stats['comm_share']:.1%} of the steps' wall time; traces in {traces} (open in https://ui.perfetto.dev)")


class Profile(Callback):
    name = "profile"

    def __init__(self, section: ProfileConfig):
        self.section = section
        self.first, self.last = section.window()
        self.prof = self.step_range = None
        self.started_at: Optional[int] = None
        self.snapshot = False
        self.pending: Optional[str] = None  # the summary line, said after the last step's own record

    def setup(self, run) -> None:
        import torch

        self.run = run
        self.folder = Path(run.run_dir) / "profile"
        self.cuda = run.engine.device.type == "cuda"
        if self.section.memory_snapshot and not self.cuda:
            run.say(f"profile.memory_snapshot=true needs CUDA (this run's device is {run.engine.device.type}): "
                    f"no memory snapshot; training goes on")
        self._torch = torch
        window = f"profile.steps={self.first}-{self.last}"
        if run.done >= self.last:
            run.say(f"{window}: those steps were done before this run started (at step {run.done}); nothing is "
                    f"profiled")
        elif self.first > run.cfg.train.max_steps:
            run.say(f"{window} begins after train.max_steps={run.cfg.train.max_steps}: nothing is profiled")

    def before_step(self, step: int) -> None:
        self._say_pending()
        if self.prof is None and self.started_at is None and self.first <= step <= self.last:
            self._start(step)
        if self.prof is not None:
            self._end_step()  # a rollback inside the window left its step's range open
            self.step_range = self._torch.profiler.record_function(f"ProfilerStep#{step}")
            self.step_range.__enter__()

    def after_step(self, step: int) -> None:
        if self.prof is None:
            return
        self._end_step()
        if step >= self.last:
            self._finish(step)

    def on_stop(self, step: int) -> None:
        if self.prof is not None:  # the run ended inside the window: what was recorded
            self._end_step()
            self._finish(step)
        self._say_pending()

    def _say_pending(self) -> None:
        if self.pending is not None:
            self.run.say(self.pending)
            self.pending = None

    def on_error(self, exc: BaseException) -> None:
        if self.prof is not None:  # no trace of a failed step; the profiler and the history are let go
            self.step_range = None
            prof, self.prof = self.prof, None
            try:
                prof.__exit__(None, None, None)
            finally:
                if self.snapshot:
                    self._torch.cuda.memory._record_memory_history(enabled=None)

    def _start(self, step: int) -> None:
        torch = self._torch
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.snapshot = self.section.memory_snapshot and self.cuda
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=self.section.memory_entries)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=self.section.record_shapes,
                                           with_stack=self.section.with_stack)
        self.prof.__enter__()
        self.started_at = step

    def _end_step(self) -> None:
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None

    def _finish(self, step: int) -> None:
        torch, rank = self._torch, self.run.topo.rank
        if self.cuda:
            torch.cuda.synchronize()
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = free_path(self.folder, f"rank{rank}_steps{self.started_at}-{step}", ".json")
        tmp = trace.with_name(f".{trace.name}.tmp{os.getpid()}")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)
        if self.snapshot:
            snap = free_path(self.folder, f"rank{rank}_memory", ".pickle")
            torch.cuda.memory._dump_snapshot(str(snap))
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.run.topo.is_main:
            stats = summarize(prof, self.section.top, device=self.cuda)
            self.pending = (summary_line(self.started_at, step, self.folder, trace.name, stats,
                                         self.run.topo.world_size))


def build(section: ProfileConfig, cfg) -> Optional[Profile]:
    return Profile(section) if section.window() else None
