"""``<run_dir>/slurm/plan_choice.json``: the ``megafixed plan`` row that ``submit --layout best`` chose for this run.

``submit`` writes it (atomically) before the job is queued; the trainer reads it through :func:`read`
and keeps it in every checkpoint's run record. A file in the run directory, not a variable in the job
script's environment: what a run does is in its config and its run directory, where anyone can see it.
Under ``slurm/``, beside the job scripts and jobs.jsonl, which a fresh start leaves in place.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Union

NAME = os.path.join("slurm", "plan_choice.json")
PathLike = Union[str, os.PathLike]



class PlanChoiceError(ValueError):
    """The run directory's chosen row names another layout and ``--overwrite`` was not given (exit 2)."""

def path(run_dir: PathLike) -> str:
    return os.path.join(os.fspath(run_dir), NAME)


def read(run_dir: PathLike) -> Optional[dict]:
    """The chosen plan row, or None when the run was not laid out by ``submit --layout best``.
    A file that is not a JSON object is a ValueError naming it and the fix."""
    file = path(run_dir)
    try:
        with open(file, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    try:
        chosen = json.loads(text)
    except json.JSONDecodeError as exc:
        chosen = exc
    if not isinstance(chosen, dict):
        raise ValueError(f"{file} is not a JSON object (the plan row `submit --layout best` wrote); delete it, or "
                         f"submit again with --layout best --overwrite")
    return chosen


def write(run_dir: PathLike, chosen: dict, overwrite: bool = False) -> str:
    """Write ``chosen``; an existing file naming another row is replaced only with ``overwrite``."""
    from ..atomic import atomic_write_text

    file = path(run_dir)
    if not overwrite:
        try:
            old = read(run_dir)
        except ValueError:
            old = {"unreadable": True}
        if old is not None and old != chosen:
            raise PlanChoiceError(f"{file} names another layout (row {old.get('row')} of `{old.get('chosen_by')}`, "
                              f"{' '.join(old.get('overrides', []))}); this run was laid out by another plan: pass "
                              f"--overwrite to replace it, or use another train.run_dir")
    os.makedirs(os.path.dirname(file), exist_ok=True)
    atomic_write_text(file, json.dumps(chosen, sort_keys=True, indent=1) + "\n")
    return file


def remove(run_dir: PathLike) -> bool:
    try:
        os.remove(path(run_dir))
        return True
    except FileNotFoundError:
        return False


def spelled(chosen: dict) -> str:
    """The trainer's start-up line for it."""
    return f"layout: row {chosen.get('row')} of `{chosen.get('chosen_by')}` ({' '.join(chosen.get('overrides', []))})"


def note(checkpointer, say) -> None:
    """Keep the run directory's chosen row, if any, in every run record (``checkpointer.note``) and say it."""
    chosen = read(checkpointer.run_dir.path)
    if chosen is not None:
        checkpointer.note(layout_chosen_by_plan=chosen)
        say(spelled(chosen))
