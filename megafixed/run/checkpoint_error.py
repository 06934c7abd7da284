"""``CheckpointError``: the one error type of run directories and checkpoints, in a module of its
own so that the lowest layer (``run_dir``, ``run_lock``) can raise it without importing each other."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says why and what to change."""
