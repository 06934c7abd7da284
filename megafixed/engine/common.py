"""What both engines' checkpoint code says and does the same way: waiting for a background save,
the one-line summary of a library's many-line error, the two ways a resume is refused, and the
key check of initial weights against the model.

Engine-agnostic (torch and the standard library only): the DeepSpeed engine
(``deepspeed/async_save.py``, ``deepspeed/engine.py``, ``deepspeed/init_weights.py``) and the
torch engine (``native/checkpoint.py``) use these, so the two cannot drift apart in wording or in
how an error raised in a save thread reaches the training thread.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterable, Optional

from ..run.checkpoint_error import CheckpointError


class BackgroundSave:
    """The save thread in flight and the error it left: ``wait`` joins the one and raises the other
    in the training thread (where the commit protocol can handle it). A subclass starts
    ``self._thread`` and stores into ``self._error`` whatever its thread raised."""

    _thread: Optional[threading.Thread] = None
    _error: Optional[BaseException] = None

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raise what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err


def one_line(msg, keep: int = 3) -> str:
    """A library's many-line error (torch's load_state_dict lists every tensor on its own line) as
    one line: the first ``keep`` non-blank lines and how many more there were."""
    lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip()]
    more = f" (+{len(lines) - keep} more)" if len(lines) > keep else ""
    return " ".join(lines[:keep]) + more


def corrupt_checkpoint_error(tag_dir: Path, detail: str) -> CheckpointError:
    """A missing or truncated file: the checkpoint is damaged, the model has not changed."""
    from ..run.run_dir import LATEST

    return CheckpointError(f"cannot resume from {tag_dir}: it is incomplete or corrupt ({detail}); "
                           f"point {tag_dir.parent / LATEST} at an earlier tag, or delete it to start from scratch")


def misfit_checkpoint_error(tag_dir: Path, library: str, detail: str) -> CheckpointError:
    """A whole checkpoint of another model: the fix is the run's own model config, or a new run."""
    from ..run.run_dir import RunDirectory

    return CheckpointError(f"cannot resume from {tag_dir}: the checkpoint does not fit this model; set model.* "
                           f"back to the run's own {RunDirectory(tag_dir.parent.parent).config_file} or use a "
                           f"new train.run_dir. {library} said: {detail}")


def key_mismatch(want: Iterable[str], have: Iterable[str]) -> Optional[str]:
    """Why initial weights with keys ``have`` do not fit a model with keys ``want`` (None: they do)."""
    want, have = set(want), set(have)
    if want == have:
        return None
    missing, extra = sorted(want - have)[:4], sorted(have - want)[:4]
    return f"its weights do not fit this model (missing {missing}, extra {extra})"
