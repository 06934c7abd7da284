"""Steps whose batches are consumed without training (Megatron's ``--iterations-to-skip``; PaLM's
restart-and-skip of the batches around a loss spike).

Two sources, one set: ``data.skip_steps`` (``"5-6,900-1200"``, steps as numbered in the logs,
ranges inclusive) and the windows a rollback wrote into the run directory
(``<run_dir>/faults/skipped_steps.json``), so a resume, a requeue or a re-layout resume skips the same
data as the run that rolled back. A skipped step still advances the step counter, the learning-rate
schedule (a pure function of the step) and the data position by one global batch: the run that
skipped and a fresh run given the same ``data.skip_steps`` see the same batches at the same steps.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ....step_ranges import merge, parse

FILE = "skipped_steps.json"  # under <run_dir>/faults/


class SkipSteps:
    """The steps to skip in this run: the config's and the run directory's rollback windows."""

    def __init__(self, configured=None, faults_dir: Optional[Path] = None):
        self.configured = parse(configured)
        self.file = Path(faults_dir) / FILE if faults_dir is not None else None
        self.rolled_back = self._read()
        self.ranges = merge(self.configured + self.rolled_back)

    def windows(self) -> list[dict]:
        """The rollback windows recorded in the run directory: ``{"first", "last", "reason"}`` each."""
        if self.file is None or not self.file.exists():
            return []
        return list(json.loads(self.file.read_text()).get("windows", []))

    def _read(self) -> list[tuple[int, int]]:
        return merge((int(w["first"]), int(w["last"])) for w in self.windows())

    def __contains__(self, step: int) -> bool:
        return any(a <= step <= b for a, b in self.ranges)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def add_window(self, first: int, last: int, reason: str, write: bool) -> None:
        """A rollback's window: skipped from now on, and (rank 0: ``write``) kept in the run directory."""
        self.rolled_back = merge(self.rolled_back + [(first, last)])
        self.ranges = merge(self.configured + self.rolled_back)
        if not write or self.file is None:
            return
        from ....atomic import atomic_write_text

        old = json.loads(self.file.read_text()) if self.file.exists() else {"windows": []}
        old["windows"].append({"first": first, "last": last, "reason": reason})
        self.file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.file, json.dumps(old, indent=2) + "\n")
