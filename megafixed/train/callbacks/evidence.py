"""What a failed run leaves (``train/evidence.py``) as a callback: a run directory this trainer created is
removed after a failure if nothing but its own start-up files are in it; otherwise all of it is kept, and
the exit line says where. A fresh start first sets aside what an earlier attempt left without a checkpoint."""
from __future__ import annotations

from pathlib import Path

from ..evidence import RunFiles, set_aside_earlier_attempt
from .base import Callback


class Evidence(Callback):
    name = "evidence"

    def __init__(self, run_dir: Path):
        self.made, self.is_main = RunFiles(run_dir, created=not run_dir.exists()), None

    def preflight(self, topo, resume, say) -> None:
        self.is_main = topo.is_main
        if resume is None and self.is_main:  # a fresh start: an earlier attempt's files (no checkpoint) go aside
            set_aside_earlier_attempt(self.made.run_dir, say)

    def on_start(self) -> None:
        if self.is_main:
            self.made.first_step()  # what is in a new run directory now is the trainer's own

    def on_error(self, exc: BaseException) -> None:
        kept = self.made.after_failure() if _main(self.is_main) else None
        if kept and isinstance(exc, Exception):
            exc.add_note(kept)  # the exit line says where (errors.report prints the notes)


def _main(is_main) -> bool:
    """Rank 0 -- also for a failure before ``preflight`` told it (the resume check's): the process group's."""
    if is_main is not None:
        return is_main
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def build(section, cfg) -> Evidence:
    return Evidence(Path(section.run_dir))
