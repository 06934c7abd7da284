"""Progress for logs: plain lines at a steady pace where a terminal would get a tqdm bar.

A bar redraws itself with carriage returns, which a log file (Slurm's, ``| tee``, a CI job) shows as
one endless line, or not at all until the end; so where stderr is not a terminal, long loops print a
line every ``every_s`` seconds instead: done/total, percent, elapsed, ETA.
"""
from __future__ import annotations

import sys
import time


def _fmt(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class ProgressLines:
    """The part of tqdm's interface the loops use (``update``, ``close``)."""

    def __init__(self, total: int, desc: str, unit: str, every_s: float = 30.0, stream=None, clock=time.monotonic):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.stream = stream or sys.stderr
        self.clock = clock
        self.start = self.last = clock()
        self.done = 0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        if now - self.last >= self.every_s and self.done < self.total:
            self.last = now
            self._line(now)

    def _line(self, now: float) -> None:
        elapsed = now - self.start
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = elapsed * (self.total - self.done) / self.done if self.done else float("nan")
        tail = f", ETA {_fmt(eta)}" if self.done < self.total and eta == eta else ""
        print(f"{self.desc}: {self.done:,}/{self.total:,} {self.unit} ({pct:.0f}%), {_fmt(elapsed)}{tail}",
              file=self.stream, flush=True)

    def close(self) -> None:
        if self.total and self.clock() - self.start >= self.every_s:  # a short loop stays quiet
            self._line(self.clock())


def progress_mode(disabled: bool, stream=None) -> str | bool:
    """``"bar"`` on a terminal, ``"lines"`` elsewhere, False when the user turned progress off."""
    if disabled:
        return False
    return "bar" if (stream or sys.stderr).isatty() else "lines"
