"""What a failed run leaves is evidence, and evidence is never deleted.

* A run that fails removes the run directory it created only if nothing is in it but what the trainer
  itself made before its first step (the resolved config, the engine's record, a step-0 validation
  record: ``RunFiles``) -- a run refused at start leaves no directory behind. Anything more (a
  metrics record of a step, TensorBoard events, the stacks of a hang, a bad step's verdict) keeps all
  of it, and the exit line says where.
* A fresh start (no checkpoint) in a directory an earlier attempt left files in sets them aside under
  ``<run_dir>/attempts/<n>/`` and says so: the new run neither deletes them nor mixes its records into
  theirs. ``slurm/`` (the job scripts and the log the running job is writing) and ``attempts/`` stay.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from ..run.run_dir import LOCK

ATTEMPTS = "attempts"
STAYS = (LOCK, ATTEMPTS, "slurm")  # what a fresh start leaves where it is


def files_of(root: Path) -> dict:
    """Every file under ``root`` but the lock: relative path -> size."""
    out = {}
    for path in sorted(Path(root).rglob("*")):
        if path.is_file() and path.name != LOCK:
            out[str(path.relative_to(root))] = path.stat().st_size
    return out


class RunFiles:
    """Rank 0's account of what this trainer made in a run directory it created, before its first step."""

    def __init__(self, run_dir: Path, created: bool):
        self.run_dir, self.created = Path(run_dir), created
        self.before_first_step: Optional[dict] = None  # None: the first step has not begun

    def first_step(self) -> None:
        """Just before the first step: everything there now is the trainer's own."""
        if self.created:
            self.before_first_step = files_of(self.run_dir)

    def after_failure(self) -> Optional[str]:
        """Remove the directory if it holds only the trainer's own files; else what is kept, in words."""
        if not self.run_dir.is_dir():
            return None
        now = files_of(self.run_dir)
        if self.created and (self.before_first_step is None or now == self.before_first_step):
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return None
        if not now:
            return None
        tops = sorted({rel.split(os.sep)[0] + ("/" if os.sep in rel else "") for rel in now})
        return f"the failed run's files are kept in {self.run_dir} ({', '.join(tops)})"


def set_aside_earlier_attempt(run_dir: Path, say) -> Optional[Path]:
    """Rank 0, on a fresh start: move what an earlier attempt without a checkpoint left into
    ``attempts/<n>/`` (the next free n); returns where, or None when there was nothing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    left = sorted(p for p in run_dir.iterdir() if p.name not in STAYS)
    if not left:
        return None
    root = run_dir / ATTEMPTS
    taken = [int(p.name) for p in root.iterdir() if p.name.isdigit()] if root.is_dir() else []
    dest = root / str(max(taken, default=0) + 1)
    dest.mkdir(parents=True)
    for path in left:
        os.rename(path, dest / path.name)
    say(f"set aside what an earlier attempt left here without a checkpoint ({', '.join(p.name for p in left)}) "
        f"in {dest}; this run starts fresh")
    return dest
