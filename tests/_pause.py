"""The tests' side of ``MEGAFIXED_PAUSE`` (megafixed/pause.py): catch work mid-way without racing the clock.

A test sets the pause, starts the work and waits for its file: the file appears only once the process
is stopped at that point, and it stays until the test acts (a signal, a kill, the file's removal), so
however fast the machine is the work cannot end first. The wait's timeout is an upper bound for a
hang only, never what a test asserts.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional


def pause_env(point: str, marker: Path) -> dict:
    """The environment that pauses at ``point`` (e.g. ``train.step@4:rank=0``) and writes ``marker`` there."""
    return {"MEGAFIXED_PAUSE": f"{point}:file={marker}"}


def wait_paused(marker: Path, gone: Callable[[], Optional[str]], timeout: float = 300) -> None:
    """Until ``marker`` exists. ``gone()`` returns why the work can no longer pause (it ended: its log) or
    None while it runs; either that or ``timeout`` (a hang) fails the test, saying which."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        why = gone()
        if why is not None and not marker.exists():
            raise AssertionError(f"the work ended without pausing at {marker}: {why}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no pause at {marker} within {timeout:.0f}s (a hang)")
        time.sleep(0.05)


def ended(proc, log: Optional[Path] = None) -> Callable[[], Optional[str]]:
    """``gone`` for a subprocess: its exit code and the tail of its log once it has exited."""
    def gone() -> Optional[str]:
        if proc.poll() is None:
            return None
        return f"exit {proc.returncode}: " + (log.read_text()[-3000:] if log is not None and log.exists() else "")
    return gone
