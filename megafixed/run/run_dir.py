"""``RunDirectory``: the one object that knows how a run directory is laid out.

    <run_dir>/config.yaml            the resolved config of the latest (re)start
    <run_dir>/ds_config.json         the DeepSpeed JSON it ran with (train.engine=deepspeed)
    <run_dir>/torch_engine.json      the torch-native engine's record: mesh, FSDP2, precision (train.engine=torch)
    <run_dir>/metrics.jsonl          one JSON object per logged step
    <run_dir>/tensorboard/           TensorBoard events (``metrics.tensorboard=true``)
    <run_dir>/.megafixed.lock        the writer's lock while a trainer runs (``run_lock.py``)
    <run_dir>/checkpoints/latest     one line: the tag of the newest *complete* checkpoint
    <run_dir>/checkpoints/<tag>/     DeepSpeed's files, ``run.json`` and ``manifest.json``

Every name above is spelled here and nowhere else in ``megafixed.train``, ``megafixed.parallel``
and ``megafixed.engine``. ``ds_config.json`` / ``torch_engine.json`` is the engine's own config
record (``engine_config_file(engine)``). It imports nothing heavy (no torch), so
the CLI's cheap checks (``submit``, ``ckpt``) can use it, and it imports nothing of
``megafixed.train`` back (``lock`` imports ``run_lock`` when called).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional, Union

from .checkpoint_error import CheckpointError, DamagedCheckpoint  # noqa: F401  (re-exported: raised by every reader)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
LOCK = ".megafixed.lock"
MANIFEST = "manifest.json"
RUN_RECORD = "run.json"
TAG_RE = re.compile(r"^step_(\d+)$")  # a checkpoint tag: step_00000100
# What ``latest`` may name: a run's step tag, the tag `megafixed import hf` / `convert` write, or DeepSpeed's
# own default (``global_stepN``, a checkpoint saved without a tag). A name with a path in it (``../x``,
# ``/abs``) would send every reader outside the run directory.
LATEST_TAG_RE = re.compile(r"^(step_\d+|global_step\d+|imported|converted)$")
# A DeepSpeed checkpoint folder from elsewhere (``megafixed convert``'s input) may use any tag DeepSpeed
# accepted: still one plain name in that folder.
PLAIN_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


def tag_for(step: int) -> str:
    """The tag of the checkpoint taken after ``step`` optimizer steps."""
    return f"step_{step:08d}"


def tag_step(tag: str) -> int:
    """The step a tag names (-1: not a step tag, e.g. an imported checkpoint)."""
    m = TAG_RE.match(tag)
    return int(m.group(1)) if m else -1


class RunDirectory:
    """A run directory (``train.run_dir``); nothing is created by constructing one."""

    def __init__(self, path: Union[str, os.PathLike], trusted: bool = False):
        self.path = Path(path)
        self.trusted = trusted  # train.trust_run_dir: someone else's (or a group-writable) one is read knowingly

    def __repr__(self) -> str:
        return f"RunDirectory({str(self.path)!r})"

    # ---- where things are
    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def latest_file(self) -> Path:
        return self.checkpoints / LATEST

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG

    def engine_config_file(self, engine: str) -> Path:
        """Where the config record of ``engine`` (``train.engine``; ``EngineKind.engine_config``) goes:
        its ``EngineFacts.record_file`` (``ds_config.json``, ``torch_engine.json``)."""
        from ..engines import engine_kind

        return self.path / engine_kind(engine).facts.record_file

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / TENSORBOARD

    @property
    def lock_file(self) -> Path:
        return self.path / LOCK

    @property
    def faults_dir(self) -> Path:
        """What went wrong and what was done about it: hang stacks, bad-step verdicts, skipped-step windows."""
        return self.path / "faults"

    def tag_dir(self, tag: str) -> Path:
        return self.checkpoints / tag

    def manifest_file(self, tag: str) -> Path:
        return self.tag_dir(tag) / MANIFEST

    def run_record_file(self, tag: str) -> Path:
        return self.tag_dir(tag) / RUN_RECORD

    def init_scratch(self) -> Path:
        """A scratch folder for ``train.init_from``'s re-sharded weights (removed after loading)."""
        return self.path / ".init_from"

    # ---- what is there
    def tags(self) -> list[str]:
        return checkpoint_tags(self.checkpoints)

    def read_metrics(self) -> list[dict]:
        """The records of ``metrics.jsonl``, in order ([] before the first logged step)."""
        path = self.metrics_file
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def read_latest(self) -> Optional[str]:
        """The tag ``latest`` names (None: no checkpoint yet). Read it once per use: a caller that
        reads it twice may see two tags if another process moves it in between."""
        return read_latest(self.checkpoints)

    def check_trusted(self) -> None:
        """Refuse a run directory (or a checkpoint in it) that another user owns or group/others can
        write, unless ``trusted`` (``megafixed.trust.owner``)."""
        from ..trust.owner import check_run_dir

        check_run_dir(self.path, trusted=self.trusted, flag="train.trust_run_dir=true")

    def lock(self, **kwargs):
        """The run's writer lock (``run_lock.RunLock``), not yet taken: ``with rd.lock(): ...``."""
        from .run_lock import RunLock

        return RunLock(self.lock_file, **kwargs)


def checkpoint_tags(ckpt_dir: Union[str, os.PathLike]) -> list[str]:
    root = Path(ckpt_dir)
    return sorted(p.name for p in root.iterdir() if p.is_dir() and TAG_RE.match(p.name)) if root.is_dir() else []


def read_latest(ckpt_dir: Union[str, os.PathLike]) -> Optional[str]:
    """The tag ``<ckpt_dir>/latest`` names, checked to exist; None when there is no ``latest``."""
    path = Path(ckpt_dir) / LATEST
    if not path.exists():
        return None
    tag = path.read_text(errors="replace").strip()
    if not tag:
        raise CheckpointError(f"{path} is empty; write the tag to resume from into it (one of: "
                              f"{', '.join(checkpoint_tags(ckpt_dir)) or 'none found'}), or delete it to start "
                              f"from scratch")
    why = latest_problem(ckpt_dir, tag)
    if why:
        raise DamagedCheckpoint(f"{path} {why}; the checkpoint pointer is damaged: write the tag to resume from "
                                f"into it (one of: {', '.join(checkpoint_tags(ckpt_dir)) or 'none found'}), or "
                                f"delete it to start from scratch", why="latest")
    if not (Path(ckpt_dir) / tag).is_dir():
        raise CheckpointError(f"{path} points to '{tag}', which does not exist under {ckpt_dir}; "
                              f"restore that directory or delete {path} to start from scratch")
    return tag


def latest_problem(ckpt_dir: Union[str, os.PathLike], name: str, pattern: re.Pattern = LATEST_TAG_RE) -> Optional[str]:
    """Why ``name`` (read from ``<ckpt_dir>/latest``) may not be followed, or None: it must be a tag of
    ``pattern`` (a run's), and the directory it names must not be a link leading out of ``ckpt_dir``."""
    if not pattern.match(name):
        kind = "a checkpoint tag of a run (step_NNNNNNNN)" if pattern is LATEST_TAG_RE else "a checkpoint tag"
        return f"names '{name[:80]}', which is not {kind} in this directory"
    target = Path(ckpt_dir) / name
    if target.is_symlink() and target.resolve().parent != Path(ckpt_dir).resolve():
        return f"names '{name}', a link leading outside {ckpt_dir}"
    return None
