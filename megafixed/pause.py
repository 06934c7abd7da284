"""Pause points: a process stops at a named point until a signal or a release, so that a test (or a
person rehearsing a failure) can act on work caught mid-way -- kill it, signal it, read its files --
without racing the clock (a fast machine can never finish first). The drills of a training run
proper are the config key ``faults.inject`` (``run/faults.py``); a pause is not a fault and is not recorded.

    MEGAFIXED_PAUSE='POINT@N[:rank=R][:host=H][:group=G][:file=PATH]'

* ``preprocess.batch@N[:group=G]``: after the N-th batch (1-based, input order) has been written to
  the temporary shards (of input-file group G only: a ``preprocess --submit`` array task);
* ``train.step@N[:rank=R][:host=H]``: before (log) step N begins, after step N-1's metrics and
  checkpoint are written (the other ranks go on into step N and wait for it in its collectives);
* ``bench.row@N``: after ``bench kernels`` wrote its N-th row to ``--json``;
* ``checkpoint.file@N``: after the first file of the step-N checkpoint is written and fsynced (the
  DeepSpeed engine's writer, sync or async: a test kills the process mid-save, however fast the machine).
  In the async writer's thread no signal ends the pause (signals are seen from the main thread): only
  the release does, or kill -9.

``host=H`` matches this machine's hostname (every point). There the process prints one line on
stderr, writes ``PATH`` (if given; its pid, host and point; ``{rank}``, ``{group}`` and ``{host}`` in it
are this process's, so that several processes pausing at once each have their own) and waits. The
pause ends when

* a signal the process handles arrives (its handler has run by then: training's USR1/TERM/Ctrl-C
  request a stop, which happens at the end of step N as always; a handler that raises -- Ctrl-C's
  KeyboardInterrupt, ``preprocess --submit``'s TERM -- unwinds from the pause as from anywhere);
  a signal the process does not handle does what it always does (kill -9, a TERM with no handler);
* or ``PATH`` is removed (the release).

``PATH`` is removed when the pause ends (a killed process leaves it). A test waits for ``PATH`` to
appear, which it does only once the process is stopped there. The pause fires once per process; a
point that is never reached never pauses. Signals are seen from the main thread only (every point
above runs there, but ``checkpoint.file`` under ``checkpoint.async_save``). Unset, :func:`armed` returns
None and the point costs one ``is None`` test per batch, step or row (one environment look-up per
checkpoint file); a malformed value is one :class:`PauseError` line naming this grammar.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
from typing import Mapping, Optional

from . import env as env_vars
from .atomic import atomic_write_text

ENV = "MEGAFIXED_PAUSE"
# point -> its own keys
POINTS = {"preprocess.batch": ("group",), "train.step": ("rank",), "bench.row": (), "checkpoint.file": ()}
GRAMMAR = ("POINT@N[:KEY=VALUE...][:file=PATH] with POINT one of preprocess.batch (key group), train.step "
           "(key rank), bench.row or checkpoint.file, and host=H for any -- "
           "e.g. MEGAFIXED_PAUSE='train.step@4:rank=0:file=/tmp/p'")


class PauseError(ValueError):
    """A malformed ``MEGAFIXED_PAUSE`` (exit 2, one line)."""


class Pause:
    """An armed pause: ``reached(n)`` at each batch/step/row stops the process at the one it names."""

    def __init__(self, point: str, at: int, file: Optional[str], spelled: str):
        self.point, self.at, self.file, self.spelled = point, at, file, spelled
        self.fired = False

    def reached(self, n: int) -> None:
        if n == self.at and not self.fired:
            self.fired = True
            self._wait()

    def _wait(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        r, w = os.pipe()
        os.set_blocking(w, False)
        # Every signal with a Python handler writes its number to the wakeup fd from its C handler, whichever
        # thread the kernel delivered it to; the Python handler itself then runs here, in the main thread.
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False) if main else None
        try:
            if self.file:  # whole or absent: a test that sees it may read it at once
                atomic_write_text(self.file, f"{os.getpid()} {socket.gethostname()} {self.spelled}\n")
            how = f"remove {self.file} or send a signal" if self.file else "send a signal"
            print(f"paused at {self.spelled} ({ENV}; pid {os.getpid()} on {socket.gethostname()}): {how} to go on",
                  file=sys.stderr, flush=True)
            while self.file is None or os.path.exists(self.file):
                if select.select([r], [], [], 0.1)[0] and os.read(r, 64):
                    break
        finally:
            if main:
                signal.set_wakeup_fd(previous)
            os.close(r)
            os.close(w)
            if self.file:
                try:
                    os.remove(self.file)
                except FileNotFoundError:
                    pass


def parse(raw: str) -> tuple[str, int, dict, Optional[str]]:
    """(point, N, {key: value}, PATH) of a ``MEGAFIXED_PAUSE`` value, or PauseError naming what is wrong."""
    def bad(why: str) -> PauseError:
        return PauseError(f"{ENV}={raw!r} {why}; expected {GRAMMAR}, or unset {ENV}")

    head, *options = raw.strip().split(":")
    point, at, n = head.partition("@")
    if point not in POINTS:
        raise bad(f"names no pause point ({point!r})")
    if not at or not n.isdigit() or int(n) < 1:
        raise bad(f"needs @N with N >= 1 after {point}")
    where, path = {}, None
    for i, opt in enumerate(options):
        key, eq, value = opt.partition("=")
        if key == "file" and eq:
            path = ":".join([value, *options[i + 1:]])  # the path comes last, and may hold ':' itself
            if not path:
                raise bad("has an empty file=")
            break
        if not eq or key not in (*POINTS[point], "host") or not value:
            raise bad(f"has an option {opt!r} that {point} does not take")
        if key != "host" and not value.isdigit():
            raise bad(f"has {key}={value!r}, not a number")
        where[key] = value
    return point, int(n), where, path


class _Known(dict):
    def __missing__(self, key):
        raise PauseError(f"{ENV}: file= names {{{key}}}, which this process does not know (it knows "
                         f"{', '.join('{' + k + '}' for k in self)})")


_ARMED: dict = {}  # one Pause per (value, point, where): it fires once per process, however often it is armed


def armed(point: str, env: Optional[Mapping[str, str]] = None, **where) -> Optional[Pause]:
    """The pause ``MEGAFIXED_PAUSE`` sets at ``point`` for this process (``where``: its rank, group, ...),
    or None: not set, another point, or another rank/group/host."""
    raw = env_vars.pause(env)
    if not raw:
        return None
    name, at, keys, path = parse(raw)
    mine = {"host": socket.gethostname(), **{k: str(v) for k, v in where.items() if v is not None}}
    if name != point or any(mine.get(k) != v for k, v in keys.items()):
        return None
    key = (raw, point, tuple(sorted(mine.items())))
    if key not in _ARMED:
        path = path.format_map(_Known(mine)) if path else None  # e.g. file=/tmp/paused.{rank}: one per rank
        _ARMED[key] = Pause(point, at, path, raw.partition(":file=")[0])
    return _ARMED[key]
