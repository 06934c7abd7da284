"""Stragglers named (Megatron core's ``StragglerDetector``): every log interval the ranks' step times
are gathered, and a rank whose compute is slower than ``stragglers.factor`` x the median is named
with its host, in one line and in ``metrics.jsonl``; the per-rank figures are in every record.

Per rank and step, two figures:

* ``compute_s``: the time in the model's forward passes of the step (hooks on the rank's module).
  Under data parallelism a forward holds no collective, so it is this rank's own speed; a slow or
  throttled GPU shows here. On CUDA the time comes from CUDA events read at the log interval, so no
  host sync is added per step; on CPU it is the process's CPU time (``time.process_time``), since a
  few-millisecond forward's wall time on a shared machine is mostly the scheduler's noise. The
  backward is not timed on its own because the engines' gradient reduction runs inside it.
* ``wait_s``: the rest of the step's wall time -- backward, reductions and waiting for the slowest
  rank. In lock-step training every rank's wall time is the same, so only ``compute_s`` can tell
  which rank is slow; a rank with a small ``compute_s`` and a large ``wait_s`` is waiting for others.

One all-gather of 2 floats per rank per log interval; nothing per step beyond the hooks' clocks.
A straggler is also a line of ``<run_dir>/faults/stragglers.jsonl``, which -- unlike ``metrics.jsonl``,
truncated past its checkpoint by a resume -- keeps every one a run saw.
"""
from __future__ import annotations

import contextlib
import json
import socket
import statistics
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist


class ForwardClock:
    """Sums the time of the module's forwards while ``active`` (a training step, not validation)."""

    def __init__(self, module: torch.nn.Module, device, on_forward=None):
        self.cuda = torch.device(device).type == "cuda"
        self.now = time.perf_counter if self.cuda else time.process_time
        self.active, self.host_s, self.events, self._t0 = False, 0.0, [], None
        self.on_forward = on_forward  # the ``slow`` fault: called with each forward's seconds
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, _module, _args):
        if not self.active:
            return
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.events.append([start, None])
        self._t0 = self.now()

    def _post(self, _module, _args, _out):
        if not self.active or self._t0 is None:
            return
        seconds = self.now() - self._t0
        if self.on_forward is not None:
            self.on_forward(seconds)  # before the clock stops: an injected slow-down is compute
            seconds = self.now() - self._t0
        self.host_s += seconds
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events[-1][1] = end
        self._t0 = None

    def take(self) -> float:
        """Seconds of forward since the last take (CUDA: the events' device time; syncs on them)."""
        if self.cuda and self.events:
            total = sum(a.elapsed_time(b) for a, b in self.events if b is not None) / 1000.0
            total += self.host_s if self.on_forward is not None else 0.0  # an injected host sleep
        else:
            total = self.host_s
        self.host_s, self.events = 0.0, []
        return total


class StragglerReport:
    def __init__(self, *, factor: float, world: int, device, hosts: Optional[list] = None):
        self.factor, self.world, self.device = float(factor), world, torch.device(device)
        self.hosts = hosts or [socket.gethostname()] * world
        self.steps, self.wall_s = 0, 0.0

    def add_step(self, wall_s: float) -> None:
        self.steps += 1
        self.wall_s += wall_s

    def gather(self, compute_s: float) -> Optional[dict]:
        """On every rank (a collective): the per-rank means since the last gather (``compute_s``: the
        forward time of those steps, ``ForwardClock.take``), and the stragglers."""
        if self.steps == 0:
            return None
        mine = torch.tensor([self.wall_s / self.steps, compute_s / self.steps], dtype=torch.float64)
        self.steps, self.wall_s = 0, 0.0
        if self.world > 1 and dist.is_initialized():
            dev = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
            out = [torch.zeros(2, dtype=torch.float64, device=dev) for _ in range(self.world)]
            dist.all_gather(out, mine.to(dev))
            rows = [t.cpu().tolist() for t in out]
        else:
            rows = [mine.tolist()]
        compute = [c for _, c in rows]
        # the lower median: with two ranks the faster is the reference (the mean of two would hide a 3x one)
        median = statistics.median_low(compute)
        slow = [r for r, c in enumerate(compute) if self.world > 1 and median > 0 and c > self.factor * median]
        return {"rank_step_s": [round(w, 6) for w, _ in rows], "rank_compute_s": [round(c, 6) for c in compute],
                "rank_wait_s": [round(max(w - c, 0.0), 6) for w, c in rows], "median_compute_s": median,
                "stragglers": [{"rank": r, "host": self.hosts[r], "compute_s": compute[r]} for r in slow]}

    def line(self, step: int, figures: dict) -> Optional[str]:
        slow = figures["stragglers"]
        if not slow:
            return None
        names = ", ".join(f"rank {s['rank']} on {s['host']} ({s['compute_s'] * 1e3:.1f} ms)" for s in slow)
        return (f"straggler at step {step}: {names} of forward compute per step, over {self.factor:g}x the median "
                f"{figures['median_compute_s'] * 1e3:.1f} ms of the {self.world} ranks (stragglers.factor)")


FILE = "stragglers.jsonl"  # under <run_dir>/faults/


class Stragglers:
    """The straggler report in the loop: the rank's forwards timed while a step computes (``timing``), and
    at each log interval the gathered figures for the record (``fields``), a straggler named in one line
    that points at ``faults/stragglers.jsonl``, written first."""

    def __init__(self, engine, topo, *, factor: float, faults_dir: Path, say, slow=None):
        """``slow``: the ``slow`` drill's hook (``FaultPlan.slow_down``), run inside each timed forward."""
        from ..launch import rendezvous

        hosts = [p["host"] for p in sorted(rendezvous.peers(), key=lambda p: p["rank"])]
        self.clock = ForwardClock(engine.module, engine.device, on_forward=slow)
        self.report = StragglerReport(factor=factor, world=topo.world_size, device=engine.device,
                                      hosts=hosts if len(hosts) == topo.world_size else None)
        self.file, self.is_main, self.say = Path(faults_dir) / FILE, topo.is_main, say

    @contextlib.contextmanager
    def timing(self):
        """Around one computation of a step (validation is not timed)."""
        self.clock.active, t0 = True, time.perf_counter()
        try:
            yield
        finally:
            self.clock.active = False
        self.report.add_step(time.perf_counter() - t0)

    def fields(self, step: int) -> dict:
        """At a log interval (every rank: a collective): the per-rank step times, stragglers named."""
        figures = self.report.gather(self.clock.take())
        if figures is None:
            return {}
        line = self.report.line(step, figures)
        if line:
            if self.is_main:
                self.file.parent.mkdir(parents=True, exist_ok=True)
                with open(self.file, "a") as f:
                    f.write(json.dumps({"step": step, **figures}) + "\n")
            self.say(f"{line}; recorded in {self.file}")
        return figures
