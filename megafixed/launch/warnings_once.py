"""A library warning that every rank would print, printed once: by rank 0, with how many ranks raised it.

Why: at 32 ranks each Python warning and each WARNING record of a library's logger (torch's DTensor,
FSDP2, DCP; DeepSpeed's) came 32 times, burying the lines a user needs. No library offers a
cross-rank de-duplication, so, from the rendezvous on (``rendezvous.init_process_group`` installs
it when the world has more than one rank):

* every rank captures its Python warnings (``warnings.showwarning``) and the WARNING records its
  stream handlers would write to stdout/stderr (handlers writing files, and every other level, are
  left alone), keyed by where they come from (category or logger, file, line);
* the first time a rank sees a key it adds itself to that key's counter in the rendezvous store
  (one store round trip per distinct warning, never per step), the first rank of a key also
  posting its text;
* rank 0 alone prints, one line per key: ``warning (N of W ranks): <text>``, once the count has
  reached the world size or stayed unchanged for ``SETTLE_S`` seconds (a daemon thread polls the
  store once a second), and whatever is left when the command ends (``flush``).

Before the store exists a rank keeps what it captured and posts it at ``attach``. A rank that cannot
reach the store any more prints its own warnings as before, so nothing is lost when rank 0 is.

Capturing the log records replaces ``logging.StreamHandler.handle`` (the stdlib has no hook that sees the
records of every console handler, the ones libraries add later too): from ``install`` until ``flush``,
which puts it and ``warnings.showwarning`` back. It relies on ``Logger.callHandlers`` calling each
handler's ``handle`` and on ``StreamHandler`` inheriting ``Handler.handle`` (``WRITTEN_AGAINST``;
``tests/test_warnings_once.py`` fails if either changes).
"""
from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
import time
import warnings
from typing import Optional

WRITTEN_AGAINST = ("python", "3.11")  # the stdlib logging whose StreamHandler.handle install replaces
PREFIX = "megafixed/warnings"
POLL_S = 1.0
SETTLE_S = 10.0

_FUNNEL: Optional["Funnel"] = None


class Funnel:
    """One rank's share: capture, count in the store, and (rank 0) print each key once."""

    def __init__(self, rank: int, size: int, out=None):
        self.rank, self.size = rank, size
        self.out = out  # None: sys.stderr at the time of printing
        self.lock = threading.RLock()
        self.store = None
        self.pending: list = []  # (key, text) captured before the store was attached
        self.seen: set = set()
        self.items: dict = {}  # rank 0: digest -> [text, count, since (monotonic), printed]
        self.known = 0  # rank 0: items of the store's list read so far
        self.replaced: Optional[tuple] = None  # (warnings.showwarning, StreamHandler.handle) while installed

    # ---- every rank
    def capture(self, key: str, text: str) -> None:
        with self.lock:
            if key in self.seen:
                return
            self.seen.add(key)
            if self.store is None:
                self.pending.append((key, text))
                return
        self._post(key, text)

    def _post(self, key: str, text: str) -> None:
        digest = hashlib.sha1(key.encode()).hexdigest()[:16]
        try:
            if self.store.add(f"{PREFIX}/count/{digest}", 1) == 1:
                index = self.store.add(f"{PREFIX}/n", 1)
                self.store.set(f"{PREFIX}/item/{index}", json.dumps([digest, text]))
        except Exception:  # noqa: BLE001 -- the store is gone (rank 0 died): say it here, as before
            self._print(f"warning (rank {self.rank}): {text}")

    def attach(self, store) -> None:
        with self.lock:
            self.store, pending, self.pending = store, self.pending, []
        for key, text in pending:
            self._post(key, text)
        if self.rank == 0:
            threading.Thread(target=self._poll, name="megafixed-warnings", daemon=True).start()

    # ---- rank 0
    def report(self, final: bool = False) -> None:
        """Print every key whose count is complete, settled, or (``final``) whatever it is now."""
        if self.rank != 0 or self.store is None:
            return
        with self.lock:
            try:
                n = self.store.add(f"{PREFIX}/n", 0)
                for index in range(self.known + 1, n + 1):
                    key = f"{PREFIX}/item/{index}"
                    # A poster sets its item just after taking its index. Never wait for it here: a blocking
                    # get holds the store client's lock, which this rank's main thread needs to set the very
                    # item (a deadlock until the store's timeout, the job's collectives stuck behind it).
                    if not self.store.check([key]):
                        break
                    digest, text = json.loads(self.store.get(key))
                    self.items[digest] = [text, 0, time.monotonic(), False]
                    self.known = index
                for digest, item in self.items.items():
                    if item[3]:
                        continue
                    count = self.store.add(f"{PREFIX}/count/{digest}", 0)
                    now = time.monotonic()
                    if count != item[1]:
                        item[1], item[2] = count, now
                    if final or count >= self.size or now - item[2] >= SETTLE_S:
                        item[3] = True
                        self._print(f"warning ({item[1]} of {self.size} ranks): {item[0]}")
            except Exception:  # noqa: BLE001 -- the store went away with the job: nothing left to count
                return

    def _poll(self) -> None:
        while True:
            time.sleep(POLL_S)
            self.report()

    def _print(self, line: str) -> None:
        out = self.out or sys.stderr
        out.write(line + "\n")
        out.flush()


def _python_warning(message, category, filename, lineno, file=None, line=None) -> None:
    text = f"{filename}:{lineno}: {category.__name__}: {message}"
    _FUNNEL.capture(f"py|{category.__name__}|{filename}|{lineno}", text)


def _to_console(handler) -> bool:
    stream = getattr(handler, "stream", None)
    return stream is not None and stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)


def _handle(self, record):
    if _FUNNEL is not None and record.levelno == logging.WARNING and _to_console(self):
        _FUNNEL.capture(f"log|{record.name}|{record.pathname}|{record.lineno}",
                        f"{record.name}: {record.getMessage()}")
        return True
    original = _FUNNEL.replaced[1] if _FUNNEL is not None and _FUNNEL.replaced else logging.Handler.handle
    return original(self, record)


def install(rank: int, size: int) -> Optional[Funnel]:
    """Route this process's library warnings through the funnel (a world of one rank: nothing)."""
    global _FUNNEL
    if size <= 1:
        return None
    if _FUNNEL is None:
        _FUNNEL = Funnel(rank, size)
        _FUNNEL.replaced = (warnings.showwarning, logging.StreamHandler.handle)
        warnings.showwarning = _python_warning
        logging.StreamHandler.handle = _handle  # every console handler, the ones libraries add later too
    return _FUNNEL


def uninstall() -> None:
    """Put back what ``install`` replaced (the funnel stays, for a last ``report``)."""
    if _FUNNEL is not None and _FUNNEL.replaced is not None:
        warnings.showwarning, logging.StreamHandler.handle = _FUNNEL.replaced
        _FUNNEL.replaced = None


def attach(store) -> None:
    """The rendezvous store is up: post what was captured; rank 0 starts printing."""
    if _FUNNEL is not None and _FUNNEL.store is None:
        _FUNNEL.attach(store)


def flush() -> None:
    """The command ends: rank 0 prints every warning not printed yet, with its count so far; the
    process's warnings and console handlers are its own again."""
    if _FUNNEL is not None:
        uninstall()
        _FUNNEL.report(final=True)
