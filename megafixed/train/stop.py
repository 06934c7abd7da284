"""Asking a training run to stop cleanly at its next safe point.

``StopRequest.request()`` may be called from anywhere -- a signal handler (Slurm's pre-timeout
``USR1``, a ``TERM`` from a preemption), a callback, a test. The loop polls ``should_stop()`` at
safe points: after every optimizer step and between validation batches. It then finishes the
step, writes a checkpoint atomically and returns; ``megafixed train`` exits with
``exit_codes.STOPPED`` so a scheduler can requeue the job, and rerunning the same command resumes.

Every rank must stop at the same point, or the next collective hangs, but a signal reaches ranks
at slightly different times; ``should_stop`` therefore agrees across ranks with one tiny all-reduce
(MAX of the local flags) per poll.

Ctrl-C (SIGINT) is the same request, made at a keyboard: the first finishes the step, saves and
exits ``exit_codes.INTERRUPTED`` (130, the shell's code for an interrupt) with the resume hint; a
second one aborts at once (nothing new is saved; the last complete checkpoint stays valid, since every
checkpoint is written atomically).
"""
from __future__ import annotations

import os
import signal
import sys
import threading


class StopRequest:
    def __init__(self):
        self._event = threading.Event()
        self.reason: str | None = None
        self.interrupted = False  # the first request was a Ctrl-C (SIGINT): exit 130, not 75

    def request(self, reason: str = "stop requested", *, interrupt: bool = False) -> None:
        if not self._event.is_set():
            self.reason = reason
            self.interrupted = interrupt
        self._event.set()

    @property
    def requested(self) -> bool:
        """This rank's own flag (no communication)."""
        return self._event.is_set()

    def should_stop(self, group=None) -> bool:
        """True on every rank once any rank's flag is set (a collective: call on all ranks)."""
        # torch is imported here, not at the top: ``megafixed train`` makes its StopRequest first, and a
        # refusal before the first step (a bad config key) then answers without loading torch (1.2 s)
        import torch
        import torch.distributed as dist

        local = self._event.is_set()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return local
        flag = torch.tensor([1 if local else 0], dtype=torch.int32)
        if dist.get_backend(group) == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() and not local:
            self.request("stop requested on another rank")
        return bool(flag.item())

    def install_signal_handlers(self, signals=(signal.SIGUSR1,), interrupt: bool = False) -> None:
        """Turn these signals into a stop request (main thread only, as Python requires). With
        ``interrupt``, SIGINT too: the first is a stop request, the second aborts the process."""
        self._owner = os.getpid()
        for sig in signals:
            signal.signal(sig, self._on_signal)
        if interrupt:
            signal.signal(signal.SIGINT, self._on_sigint)

    def _in_a_fork(self, signum) -> bool:
        """A forked child (a data-preparation pool worker, a DataLoader worker) inherits these handlers;
        there the signal must do what it normally does, or ``Pool.terminate()``'s SIGTERM is swallowed
        and the parent waits for that worker forever."""
        if os.getpid() == getattr(self, "_owner", os.getpid()):
            return False
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return True

    def _on_signal(self, signum, _frame) -> None:
        if not self._in_a_fork(signum):
            self.request(f"received {signal.Signals(signum).name}")

    def _on_sigint(self, signum, _frame) -> None:
        from .. import exit_codes

        if self._in_a_fork(signum):
            return
        if self._sigint_seen:
            # Straight out: no unwinding through DeepSpeed or a collective that may be waiting on a peer.
            sys.stderr.write("\ninterrupted again: aborting now, without saving; the last complete checkpoint "
                             "resumes\n")
            sys.stderr.flush()
            os._exit(exit_codes.INTERRUPTED)
        self._sigint_seen = True
        if os.environ.get("RANK", "0") == "0":  # every rank of a terminal's job gets the signal; one speaks
            sys.stderr.write("\ninterrupt: finishing this step and saving a checkpoint (Ctrl-C again aborts at "
                             "once)\n")
            sys.stderr.flush()
        self.request("interrupted (Ctrl-C)", interrupt=True)

    _sigint_seen = False
