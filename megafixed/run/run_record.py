"""A checkpoint's run record (``<tag>/run.json``): the resolved config that trained its weights, with
the GF(2) recoding's rows and shift spelled out, and the layout that wrote it. Written by rank 0
before ``latest`` moves; read by the resume check (``resume.py``), the readers and ``megafixed
ckpt``. A low-level module: it imports nothing of the trainer or of an engine (the layout's
engine keys come from the engine registry, ``megafixed.engines``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..atomic import atomic_write_text
from ..engines import kind_of
from .run_dir import LATEST, RUN_RECORD, CheckpointError


class ResumeError(CheckpointError):
    """A rerun whose config no longer fits the run's checkpoint."""


def _resolved(cfg):
    from ..config import resolve_code
    return resolve_code(cfg)




def run_record(cfg, plan) -> dict:
    """What a checkpoint records of its run: the resolved config and the ``RunPlan``'s layout,
    including the engine whose files the tag holds (``train.engine``)."""
    return {"config": _resolved(cfg).to_dict(), "layout": record_layout(plan)}


def record_layout(plan) -> dict:
    """The layout keys of a run record: every engine's (tp, pp, dp, precision, engine; cp when > 1) and the
    plan's engine's own (``engine_layout``)."""
    kind = kind_of(plan)
    layout = {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp, **engine_layout(plan), "precision": plan.precision,
              "engine": kind.name}
    cp = getattr(plan, "cp", 1)  # a plan-like stand-in of a layout without the axis has none
    if cp > 1:  # recorded only when it splits: a record without it is cp 1
        layout["cp"] = cp
    return layout


def engine_layout(plan) -> dict:
    """The plan's engine's own layout keys, from its engine plan (``EngineFacts.record_keys``: DeepSpeed's
    ``zero_stage``; the torch engine has none, as it does not read ``zero.*``, so a record of it must not
    claim a stage)."""
    return {key: getattr(plan.engine_plan, key) for key in kind_of(plan).facts.record_keys}


def plan_engine(plan) -> str:
    return kind_of(plan).name


def record_engine(record: Optional[dict]) -> str:
    """The engine that wrote a checkpoint, from its run record (or a manifest's layout); a record
    without "engine" is in the default engine's format (``megafixed import hf``'s and ``convert``'s DeepSpeed
    files, a checkpoint of another tool without a record)."""
    lay = (record or {}).get("layout") or {}
    return kind_of(lay).name


def write_run_record(tag_dir: Path, record: dict) -> None:
    atomic_write_text(tag_dir / RUN_RECORD, json.dumps(record, indent=1, default=str))


def read_run_record(tag_dir: Path) -> Optional[dict]:
    path = Path(tag_dir) / RUN_RECORD
    if not path.exists():
        return None  # another tool's checkpoint (a DeepSpeed folder): only the engine's own load checks apply
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ResumeError(f"{path} is unreadable ({exc}); the checkpoint is damaged: point "
                          f"{Path(tag_dir).parent / LATEST} at an earlier tag or start a new train.run_dir") from exc
