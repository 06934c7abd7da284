"""Weights & Biases as a callback (``wandb.*``; the writer is ``train/wandb_log.py``): on rank 0, a sink of every
record the metrics log writes."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .base import Callback


class Wandb(Callback):
    name = "wandb"

    def __init__(self, cfg):
        from ..wandb_log import WandbLog

        self.sink = WandbLog(cfg, Path(cfg.train.run_dir))  # refuses a missing wandb package before any step

    def setup(self, run) -> None:
        if run.topo.is_main:
            run.sinks.append(self.sink)


def build(section, cfg) -> Optional[Wandb]:
    return Wandb(cfg) if section.enabled else None
