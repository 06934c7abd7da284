"""The refusals of ``megafixed.trust``: ValueErrors of ours (not ``CheckpointError``s: ``run/`` imports
this package, so it imports nothing of ``run/``), so the CLI's error boundary
(``megafixed.errors.report``) prints their one line and exits 2 (``exit_codes.BAD_INPUT``).

Neither is a ``DamagedCheckpoint``: a file that would run code, or a run directory someone else
can write, is not an accident a run should silently fall back from (``checkpoint.fallback``);
a person decides."""
from __future__ import annotations


class UntrustedCheckpoint(ValueError):
    """A checkpoint file whose pickle would import a global outside the allow-lists
    (``megafixed/trust/allowlists/``); the message names the file and the global."""


class UntrustedRunDirectory(ValueError):
    """A run directory, its ``checkpoints/`` or a checkpoint in it that another user owns or that
    group/others may write; the message names the path, the owner/mode and the fix."""
