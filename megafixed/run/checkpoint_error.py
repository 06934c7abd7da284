"""``CheckpointError``: the one error type of run directories and checkpoints, in a module of its
own so that the lowest layer (``run_dir``, ``run_lock``) can raise it without importing each other."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says why and what to change."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files fail their manifest (missing, truncated, corrupt) or whose manifest is
    unreadable: what a run may fall back from (``checkpoint.fallback``). ``why`` is one word for the
    name it is moved aside under (``step_00000008.damaged-corrupt``)."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why
