"""Weights & Biases beside metrics.jsonl and TensorBoard (``wandb.enabled=true``; ``pip install 'megafixed[wandb]'``).

The same records, at the same steps (``step=`` is the optimizer step, as in torchtitan and Megatron),
under the same ``train/*`` and ``valid/*`` names as the TensorBoard scalars.

A restarted run continues the same W&B run: its id lives in ``<run_dir>/wandb_run.json`` and is passed
back with ``resume="allow"``. The file also records the last step W&B received; records the restarted
run logs again up to there (the steps between the checkpoint and the kill) are not sent twice -- by
the reproducibility contract (train/trainer.py) they are the same values, and W&B refuses steps that
go backwards anyway.

Offline (``wandb.mode=offline`` or ``WANDB_MODE=offline``, e.g. on compute nodes without internet)
writes under ``<run_dir>/wandb/``; ``wandb sync <run_dir>/wandb/offline-run-*`` uploads every segment
into the one run.
"""
from __future__ import annotations

import json
import secrets
from pathlib import Path

from ..atomic import atomic_write_text
from ..config import ConfigError

RUN_FILE = "wandb_run.json"
NO_WANDB = "wandb.enabled=true needs the wandb package: pip install 'megafixed[wandb]' (or set wandb.enabled=false)"


def scalar_name(key: str) -> str:
    """The TensorBoard tag of a record key (``MetricsLog`` uses the same rule)."""
    return f"valid/{key}" if key.startswith("val") else f"train/{key}"


class WandbLog:
    """Rank 0's W&B sink; opened by the first record, like the other sinks."""

    def __init__(self, cfg, run_dir: str | Path):
        import importlib.util

        if importlib.util.find_spec("wandb") is None:  # before the first step, not at the first record
            raise ConfigError(NO_WANDB)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run = None
        self.last_step = -1

    def _open(self) -> None:
        import wandb
        t = self.cfg.wandb
        path = self.run_dir / RUN_FILE
        saved = json.loads(path.read_text()) if path.exists() else {}
        run_id = saved.get("id") or secrets.token_hex(4)  # W&B ids: 8 lowercase letters/digits
        self.last_step = int(saved.get("last_step", -1))
        self.run = wandb.init(project=t.project, entity=t.entity,
                              name=t.run_name or self.run_dir.name,
                              tags=list(t.tags or []) or None, id=run_id, resume="allow",
                              mode=None if t.mode == "auto" else t.mode, dir=str(self.run_dir),
                              settings=wandb.Settings(console="off"))  # our stdout is the job log already
        # Config as the run resolved it; a restart may change the "safe" keys (train/resume.py).
        self.run.config.update(self.cfg.to_dict(), allow_val_change=True)
        self._save()

    def _save(self) -> None:
        atomic_write_text(self.run_dir / RUN_FILE, json.dumps({"id": self.run.id, "project": self.run.project,
                                                               "last_step": self.last_step}) + "\n")

    def write(self, rec: dict) -> None:
        if self.run is None:
            self._open()
        step = int(rec["step"])
        if step <= self.last_step:
            return  # already in this W&B run, from before the restart
        values = {scalar_name(k): v for k, v in rec.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.run.log(values, step=step)
        self.last_step = step
        self._save()

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
