"""A library warning every rank raises is printed once, by rank 0, with the count of ranks that raised it
(``megafixed.launch.warnings_once``), here over an in-memory stand-in for the rendezvous store; the
8-rank log of a real run is checked in tests/test_native_3d.py."""
from __future__ import annotations

import io
import logging
import threading
import warnings

import pytest

from megafixed.launch import warnings_once


class MemoryStore:
    """TCPStore's ``add``/``set``/``get`` on a dict (one store shared by the ranks of the test)."""

    def __init__(self):
        self.data, self.lock, self.alive = {}, threading.Lock(), True

    def add(self, key, n):
        if not self.alive:
            raise RuntimeError("Connection reset by peer")
        with self.lock:
            self.data[key] = int(self.data.get(key, 0)) + n
            return self.data[key]

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        if key not in self.data:  # TCPStore's get waits for the key, holding the client's lock all the while
            pytest.fail(f"get({key!r}) would block: the key is not set")
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def _world(size: int, store):
    outs = [io.StringIO() for _ in range(size)]
    funnels = [warnings_once.Funnel(r, size, out=outs[r]) for r in range(size)]
    for f in funnels:
        f.store = store  # attached without rank 0's polling thread: the test reports by hand
    return funnels, outs


def test_a_warning_of_every_rank_is_printed_once_by_rank_0_with_the_count():
    store = MemoryStore()
    funnels, outs = _world(3, store)
    for f in funnels:  # every rank raises the same warning, twice (a second step)
        for _ in range(2):
            f.capture("py|UserWarning|fsdp.py|331", "fsdp.py:331: UserWarning: returned a view tensor")
    funnels[2].capture("py|UserWarning|other.py|7", "other.py:7: UserWarning: only rank 2 saw this")
    funnels[0].report()  # the complete one prints at once; the partial one waits to settle
    every = "warning (3 of 3 ranks): fsdp.py:331: UserWarning: returned a view tensor"
    assert outs[0].getvalue().splitlines() == [every]
    funnels[0].report(final=True)  # the command's end: what is left, with its count so far
    funnels[0].report(final=True)
    one = "warning (1 of 3 ranks): other.py:7: UserWarning: only rank 2 saw this"
    assert outs[0].getvalue().splitlines()[1:] == [one]
    assert outs[1].getvalue() == outs[2].getvalue() == ""  # the other ranks print nothing


def test_what_a_rank_raised_before_the_rendezvous_is_counted_and_a_lost_store_prints_locally():
    store = MemoryStore()
    early = warnings_once.Funnel(1, 2, out=io.StringIO())
    early.capture("log|torch.x|a.py|1", "torch.x: before the store existed")  # kept until attach
    assert early.pending and not store.data
    early.attach(store)  # rank 1: posts what it kept, starts no printer
    rank0 = warnings_once.Funnel(0, 2, out=io.StringIO())
    rank0.store = store
    rank0.capture("log|torch.x|a.py|1", "torch.x: before the store existed")
    rank0.report()
    assert rank0.out.getvalue() == "warning (2 of 2 ranks): torch.x: before the store existed\n"
    store.alive = False  # rank 0 (the store) is gone: a rank says its own warning, as without the funnel
    early.capture("py|UserWarning|b.py|2", "b.py:2: UserWarning: late")
    assert early.out.getvalue() == "warning (rank 1): b.py:2: UserWarning: late\n"


@pytest.fixture
def installed(monkeypatch):
    """The funnel installed in this process as rank 1 of 2 (restored afterwards)."""
    monkeypatch.setattr(warnings_once, "_FUNNEL", None)
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(logging.StreamHandler, "handle", logging.StreamHandler.handle)
    funnel = warnings_once.install(1, 2)
    assert warnings_once.install(1, 2) is funnel  # once per process
    return funnel


def test_python_warnings_and_console_log_warnings_reach_the_funnel_and_files_do_not(installed, tmp_path):
    stream, file_log = io.StringIO(), tmp_path / "rank.log"
    logger = logging.getLogger("megafixed-test-library")
    logger.propagate = False
    console = logging.StreamHandler(stream)
    console.stream = __import__("sys").stderr  # a console handler as libraries make them (stderr)
    to_file = logging.FileHandler(file_log)
    logger.handlers = [console, to_file]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = warnings_once._python_warning  # catch_warnings restored the default
            warnings.warn("a library's deprecation", FutureWarning, stacklevel=1)
        logger.warning("a library's warning record")
        logger.error("an error is every rank's own")
    finally:
        logger.handlers = []
        to_file.close()
    texts = [text for _, text in installed.pending]
    assert any("FutureWarning: a library's deprecation" in t for t in texts), texts
    assert "megafixed-test-library: a library's warning record" in texts
    assert not any("an error" in t for t in texts)
    assert "a library's warning record" in file_log.read_text()  # a file handler keeps every record


def test_a_world_of_one_rank_installs_nothing(monkeypatch):
    monkeypatch.setattr(warnings_once, "_FUNNEL", None)
    assert warnings_once.install(0, 1) is None and warnings_once._FUNNEL is None
    warnings_once.flush()  # nothing installed: nothing to do


def test_rank_0_never_waits_for_an_item_a_poster_has_numbered_but_not_yet_set():
    """A poster takes its index (``add``) and sets its item just after. Rank 0's report between the two must not
    wait for the item: on the real store that wait holds the client's lock, which rank 0's own main thread needs
    to set the item -- a deadlock until the store's timeout, with the job's collectives stuck behind it."""
    store = MemoryStore()
    funnels, outs = _world(2, store)
    digest = __import__("hashlib").sha1(b"py|UserWarning|a.py|1").hexdigest()[:16]
    store.add(f"{warnings_once.PREFIX}/count/{digest}", 2)
    store.add(f"{warnings_once.PREFIX}/n", 1)  # numbered, not yet set
    funnels[0].report(final=True)
    assert outs[0].getvalue() == ""
    store.set(f"{warnings_once.PREFIX}/item/1", f'["{digest}", "a.py:1: UserWarning: late"]')
    funnels[0].report()
    assert outs[0].getvalue().splitlines() == ["warning (2 of 2 ranks): a.py:1: UserWarning: late"]


def test_flush_puts_back_what_install_replaced(monkeypatch):
    monkeypatch.setattr(warnings_once, "_FUNNEL", None)
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(logging.StreamHandler, "handle", logging.StreamHandler.handle)
    before = (warnings.showwarning, logging.StreamHandler.handle)
    funnel = warnings_once.install(1, 2)
    assert (warnings.showwarning, logging.StreamHandler.handle) == (warnings_once._python_warning,
                                                                    warnings_once._handle)
    warnings_once.flush()
    assert (warnings.showwarning, logging.StreamHandler.handle) == before
    stream = io.StringIO()
    logger = logging.getLogger("megafixed-test-after-flush")
    logger.propagate, logger.handlers = False, [logging.StreamHandler(stream)]
    try:
        logger.warning("printed by its own handler again")
    finally:
        logger.handlers = []
    assert "printed by its own handler again" in stream.getvalue() and not funnel.pending


def test_the_stdlib_logging_route_the_patch_relies_on():
    """``install`` replaces ``StreamHandler.handle``: that is only every console record's route while the
    logger calls each handler's ``handle`` and ``StreamHandler`` has no ``handle`` of its own (a fresh
    interpreter: nothing of ours imported)."""
    import subprocess
    import sys

    check = ("import inspect, logging; "
             "assert 'handle' not in vars(logging.StreamHandler), 'StreamHandler has its own handle'; "
             "assert '.handle(record)' in inspect.getsource(logging.Logger.callHandlers), 'callHandlers changed'")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert proc.returncode == 0, (f"python {sys.version.split()[0]}'s logging no longer routes records as "
                                  f"{warnings_once.WRITTEN_AGAINST} did: {proc.stderr[-500:]}")
