"""A refusal is never lost under a launcher.

Every rank refuses a bad config, layout or preflight the same way, and only rank 0 prints the line
(``errors.report``). But the first rank to exit makes the launcher end the others: torchrun SIGTERMs
the rest of its group, ``srun --kill-on-bad-exit`` kills the step. When a rank other than 0 gets
there first, rank 0 -- maybe still importing torch, before any handler -- dies before its line is out,
and the user reads only ``ChildFailedError``. The rendezvous' "different code" verdict had the same
race under srun, fixed there by letting the other ranks wait for rank 0 (``rendezvous._check_same_code``).

The same mechanism, made prompt: a rank other than 0 that fails waits -- at most
``MEGAFIXED_REFUSAL_GRACE_S`` (default 10 s) -- for the launcher to end it, which happens as soon as
rank 0 has printed and exited; the launcher's SIGTERM (or Ctrl-C) then ends the wait at once, with
the rank's own exit code. If the grace passes (rank 0 did not fail the same
way, or a plain ``srun`` without ``--kill-on-bad-exit`` leaves the others running), this rank prints
its own line, naming itself, before exiting: a refusal is printed at least once, never lost.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

from .. import env as env_vars

DEFAULT_GRACE_S = 10.0  # ranks of one launch reach a refusal within seconds of each other


def _rank() -> int:
    for key in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 0


def _grace() -> float:
    try:
        return max(0.0, float(env_vars.refusal_grace() or DEFAULT_GRACE_S))
    except ValueError:
        return DEFAULT_GRACE_S


@contextlib.contextmanager
def term_exits_with(code: int):
    """While inside: the launcher's TERM (or Ctrl-C, a HUP) ends this process at once with ``code``,
    its own refusal's, not the signal's 143; the previous handlers are back afterwards. Main thread
    only (Python's rule for handlers); elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ended(signum, _frame):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    previous = {sig: signal.signal(sig, ended) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def give_rank0_the_lead(exc: BaseException, code: int, ended_already=lambda: False) -> None:
    """Call on the way out of a failed command, after ``errors.report``. Returns at once on rank 0,
    for a success, for an error every rank prints itself, or when the launcher's TERM already came
    (``ended_already()``: a stop handler caught it); else waits as described above."""
    from ..errors import describe

    # after_start: a failure once training ran (a lost peer, named by lost.py): not a start-up refusal,
    # and every survivor reached it alone, so waiting would only add a second line for one fault.
    if code == 0 or _rank() == 0 or getattr(exc, "every_rank", False) or getattr(exc, "after_start", False):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    with term_exits_with(code):  # the launcher ends us: rank 0 is done; keep this rank's own code
        if ended_already():  # asked after our handlers are in: a TERM cannot fall between the two
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        deadline = time.monotonic() + _grace()
        while time.monotonic() < deadline:
            time.sleep(0.05)
    found = describe(exc)
    if found is not None:
        print(f"error: rank {_rank()}: {found[1]}", file=sys.stderr, flush=True)
