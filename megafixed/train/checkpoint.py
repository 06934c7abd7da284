"""Checkpoints: the engine writes its files into the tag directory, the ``Checkpointer`` does the
rest, once, for any engine.

Layout (``RunDirectory``): ``<run_dir>/checkpoints/step_00000100/`` (the engine's files for that
step, ``run.json`` and ``manifest.json``) and ``<run_dir>/checkpoints/latest`` (one line: the
tag). The commit protocol: every rank's RNG state gathered into the client state; the engine
writes its files (in the background with ``checkpoint.async_save=true``) and reports each one's size
and sha256; each rank then writes a marker (``MARKER``) listing them; rank 0 waits for every
rank's marker, checks every file's size on disk, writes the run record and the manifest and only
then moves ``latest`` -- via a temporary file and ``os.replace`` -- and rotates old tags
(``checkpoint.keep``). A crash (kill -9) at any point leaves ``latest`` on the previous,
complete checkpoint; a full disk or a refused write is named (``save_faults.py``). Loading is the
same in reverse: verify the files against the manifest, check the run record against the new
config (``resume.py``), let the engine load (re-layout if the layout changed), restore RNG.

The checkpointer also decides its own cadence: ``checkpoint.interval``, the last step and a stop
request (``save(..., force=True)``).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from ..atomic import atomic_write_text
from ..engines import kind_of as engine_kind_of
from ..run import manifest
from ..run.checkpoint_error import DamagedCheckpoint
from ..run.run_dir import LATEST, TAG_RE, CheckpointError, RunDirectory, read_latest, tag_for, tag_step  # noqa: F401
from ..run.run_record import read_run_record, run_record, write_run_record
from .resume import check_resume, layout_changes


def write_latest(ckpt_dir: str | os.PathLike, tag: str) -> None:
    atomic_write_text(Path(ckpt_dir) / LATEST, tag + "\n")


def prune(ckpt_dir: str | os.PathLike, keep: int, protect: str) -> list[str]:
    """Delete all but the newest ``keep`` step directories (``keep <= 0`` keeps everything)."""
    if keep <= 0:
        return []
    tags = sorted((p.name for p in Path(ckpt_dir).iterdir() if p.is_dir() and TAG_RE.match(p.name)),
                  key=lambda t: int(TAG_RE.match(t).group(1)))
    doomed = [t for t in tags[:-keep] if t != protect]
    for t in doomed:
        shutil.rmtree(Path(ckpt_dir) / t, ignore_errors=True)
    return doomed


# ----------------------------------------------------------------------------------- RNG
def rng_state(torch_only: bool = False) -> dict:
    """Every generator a run draws from; ``torch_only``: torch's alone (CPU and this rank's device), what a
    training step draws from (dropout; the data has its own seeded generators) -- a re-check keeps that one
    per step (``callbacks/guard/recheck.StepReplay``: ~1 us, where Python's and numpy's states cost ~200 us to copy)."""
    state = {"torch": torch.get_rng_state()}
    if not torch_only:
        state.update(python=random.getstate(), numpy=np.random.get_state())
    if torch.cuda.is_initialized():
        # Only where this process computes on CUDA: a gloo run on a GPU host never initialises it, and
        # asking would open a context on GPU 0 in every rank. This rank's own device only: a state per
        # visible GPU (get_rng_state_all) cannot be restored where fewer GPUs are visible (one per rank
        # under Slurm/torchrun), and the others' are not ours.
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict) -> None:
    if "python" in state:  # absent from a step's torch-only state
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = _own_cuda_state(state["cuda"], torch.cuda.current_device())
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, torch.cuda.current_device())


def _own_cuda_state(saved, device_index: int):
    """The CUDA generator state to restore on ``device_index``: a checkpoint holds this rank's one
    state (a ByteTensor); older ones hold a list, one per GPU the rank could see. From such a list
    take the same index, else (fewer GPUs seen at save) the first; an empty list restores nothing."""
    if isinstance(saved, torch.Tensor):
        return saved
    saved = list(saved)
    if not saved:
        return None
    return saved[device_index] if device_index < len(saved) else saved[0]


def gather_rng_states() -> list[dict]:
    """Every rank's RNG state, so the (rank-0-written) client state can restore all of them."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [rng_state()]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, rng_state())
    return out


def restore_rng(client: dict, rank: int) -> None:
    states = client.get("rng") or []
    if len(states) == (dist.get_world_size() if dist.is_initialized() else 1):
        set_rng_state(states[rank])
    elif states:
        # A different world size: RNG streams cannot map one to one; keep rank 0's, offset by rank.
        set_rng_state(states[0])
        torch.manual_seed(torch.initial_seed() + rank)


# ----------------------------------------------------------------------------------- commit
MARKER = ".files.rank{:05d}.json"  # a rank's written files, its signal that they are complete
COMMIT_TIMEOUT_S = 3600.0


def _latest_or_none(ckpt_dir) -> Optional[str]:
    try:
        return read_latest(ckpt_dir)
    except CheckpointError:
        return None


def commit(ckpt_dir: Path, tag: str, world: int, keep: int, record: Optional[dict], meta: dict,
           derived: tuple = ()) -> None:
    """Rank 0, after its own files: wait for every rank's, check them, write run record, manifest, latest.
    ``derived``: sub-folders the engine makes from a checkpoint later (not part of what was saved)."""
    tag_dir = ckpt_dir / tag
    markers = [tag_dir / MARKER.format(r) for r in range(world)]
    deadline = time.monotonic() + COMMIT_TIMEOUT_S
    while not all(m.exists() for m in markers):
        if time.monotonic() > deadline:
            missing = [m.name for m in markers if not m.exists()]
            raise CheckpointError(f"checkpoint {tag_dir}: ranks never reported their files ({missing[:4]}); "
                                  f"`latest` stays on the previous checkpoint")
        time.sleep(0.02)
    files: dict = {}
    for m in markers:
        files.update(json.loads(m.read_text()))
    for name, rec in files.items():  # complete on disk: every recorded file, at its recorded size
        why = manifest.check_file(tag_dir, {"name": name, **rec}, checksum=False)
        if why:
            raise CheckpointError(f"checkpoint {tag_dir}: {name} is {why} right after writing; `latest` stays "
                                  f"on the previous checkpoint")
    if record is not None:
        write_run_record(tag_dir, record)
    hidden = {m.name for m in markers} | {manifest.MANIFEST}
    for path in sorted(tag_dir.rglob("*")):  # files written outside the engine (run.json, ...)
        rel = str(path.relative_to(tag_dir))
        if path.is_file() and rel not in files and path.name not in hidden and not rel.startswith(derived):
            files[rel] = manifest.record_existing(path)
    manifest.write(tag_dir, {**meta, "tag": tag}, files)
    for m in markers:
        m.unlink()
    write_latest(ckpt_dir, tag)
    prune(ckpt_dir, keep, protect=tag)


@dataclass
class ResumePoint:
    """Where a rerun continues: a verified tag, the safe config changes, whether the layout changed, and
    the damaged checkpoints passed over to reach it (``fallback.py``; not moved aside yet)."""
    tag: str
    tag_dir: Path
    changes: list = field(default_factory=list)
    relayout: bool = False
    damaged: list = field(default_factory=list)


@dataclass(frozen=True)
class RunIdentity:
    """What every checkpoint records about the run that wrote it, and what a rerun is checked against.

    The run record *is* the whole resolved config (a resume compares it key by key, and a manifest
    names the model and its code), so this view -- not the checkpointer -- is where checkpoints meet
    the whole ``Config``; the checkpointer itself runs on ``train.*`` keys and the topology."""
    record: dict  # run_record(cfg, plan): the config and the layout
    describe: Callable[[dict, int, int], dict]  # (layout, step, consumed samples) -> manifest fields
    check: Callable[[dict, Path], list]  # (an old run record, its tag dir) -> the safe changes, or raises
    seq_len: int  # data.seq_len: a manifest's consumed tokens

    @classmethod
    def of(cls, cfg, plan) -> "RunIdentity":
        return cls(record=run_record(cfg, plan),
                   describe=lambda layout, step, consumed: manifest.describe(cfg, layout, step, consumed),
                   check=lambda old, tag_dir: check_resume(old, cfg, plan, tag_dir), seq_len=cfg.data.seq_len)


class Checkpointer:
    """Saves and loads a run's checkpoints for any engine; decides when to save.

    Built from the config's ``checkpoint`` section (interval, how many to keep, fallback) and its
    ``train`` section (run dir, the last step), the topology (ranks; its ``plan``: the layout the resume
    check compares) and the run's identity (``RunIdentity``: what a checkpoint records about the config)."""

    def __init__(self, cfg, topo, identity: RunIdentity):
        train, checkpoint = cfg.train, cfg.checkpoint
        self.topo, self.identity = topo, identity
        self.run_dir = RunDirectory(train.run_dir)
        self.ckpt_dir = self.run_dir.checkpoints
        self.interval, self.keep, self.last_step = checkpoint.interval, checkpoint.keep, train.max_steps
        self.strict = not checkpoint.fallback  # a damaged checkpoint stops the run instead of being passed over
        self.record = dict(identity.record)  # what every checkpoint's run.json holds (``note``: and more)
        self.latest: Optional[str] = None  # the newest complete (or, async: in-flight) tag of this run
        self._meta: Optional[dict] = None
        # sub-folders of a tag its engine may make from it later (a re-layout copy): not among the saved files
        self.derived_dirs = engine_kind_of(topo.plan).facts.derived_dirs

    def note(self, **fields) -> None:
        """Fields every later checkpoint's run record carries (a drill, a shrink, a fallback)."""
        for key, value in fields.items():
            if isinstance(value, list):
                self.record.setdefault(key, []).extend(value)
            else:
                self.record[key] = value

    # ---- resume
    def resume_point(self) -> Optional[ResumePoint]:
        """The checkpoint ``latest`` names -- or, when its files fail their manifest, the newest older one
        whose files verify (``fallback.py``) -- with its run record checked against the new config. Nothing
        in the run dir is touched yet: a refused resume changes nothing (``set_damaged_aside`` follows)."""
        from .fallback import newest_verified

        try:
            tag = read_latest(self.ckpt_dir)
        except DamagedCheckpoint as exc:  # `latest` names no tag of this run (``../x``, ``/abs``)
            tags = sorted(self.run_dir.tags(), key=tag_step)
            if self.strict or not tags:
                raise
            tag = tags[-1]
            if self.topo.is_main:
                print(f"warning: {str(exc).partition('; ')[0]}; resuming from the newest tag that verifies, "
                      f"at or below {tag} (checkpoint.fallback)", file=sys.stderr, flush=True)
        if tag is None:
            return None
        tag, damaged = newest_verified(self.run_dir, tag, rank=self.topo.rank, world=self.topo.world_size,
                                       strict=self.strict)
        tag_dir = self.run_dir.tag_dir(tag)
        point = ResumePoint(tag=tag, tag_dir=tag_dir, damaged=damaged)
        old = read_run_record(tag_dir)
        if old is not None:
            point.changes = self.identity.check(old, tag_dir)
            point.relayout = bool(layout_changes(old, self.topo.plan))
        self.latest = tag
        return point

    def set_damaged_aside(self, point: Optional[ResumePoint], say) -> None:
        """The damaged checkpoints the resume passed over, moved aside (said, and noted in the run record)."""
        from .fallback import set_aside

        if point is not None and point.damaged:
            self.note(fallbacks=set_aside(self.run_dir, point.damaged, point.tag, is_main=self.topo.is_main,
                                          world=self.topo.world_size, when="resume", say=say))

    def load(self, engine, point: ResumePoint) -> dict:
        """The engine's state from ``point`` (re-laid out if needed), then this rank's RNG; returns
        the client state."""
        client = engine.load(point.tag_dir, relayout=point.relayout)
        restore_rng(client, self.topo.rank)
        return client

    # ---- save
    def due(self, step: int) -> bool:
        return step == self.last_step or (self.interval > 0 and step % self.interval == 0)

    def save(self, engine, step: int, consumed_samples: int, run_state: Callable[[], dict],
             force: bool = False) -> Optional[str]:
        """Save after ``step`` if it is due (or ``force``: a stop request); returns the tag or None.
        ``run_state()``: what the run needs back besides the engine and the position (schedule, config)."""
        if not (force or self.due(step)):
            return None
        state = {"step": step, "consumed_samples": consumed_samples, **run_state()}
        if self._meta is None:  # what every checkpoint's manifest describes besides its progress
            self._meta = self.identity.describe(self.record["layout"], step, state["consumed_samples"]) \
                if self.topo.is_main else {}
        meta = {**self._meta, **manifest.progress(step, state["consumed_samples"], self.identity.seq_len)}
        self.latest = self.write(engine, step, state, meta)
        return self.latest

    def write(self, engine, step: int, client_state: dict, meta: dict) -> str:
        """The engine's files, then -- once every rank's files are written -- the run record, the
        manifest and ``latest`` (rank 0). With an engine that saves in the background this returns
        while the files are still being written; the next ``write`` (or ``wait``) waits for them."""
        tag = tag_for(step)
        tag_dir = self.ckpt_dir / tag
        is_main = self.topo.is_main
        engine.wait_for_saves()  # a save in flight completes first
        distributed = dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        if is_main and tag_dir.exists() and _latest_or_none(self.ckpt_dir) != tag:
            shutil.rmtree(tag_dir)  # left by an interrupted save: its files must not mix with ours
        client_state = {**client_state, "rng": gather_rng_states()}
        if distributed:
            dist.barrier()

        def failed(exc: BaseException, asynchronous: bool = False) -> BaseException:
            # full disk / quota / permissions named; the partial tag removed; `latest` untouched
            from ..run.save_faults import named
            return named(exc, self.ckpt_dir, tag, is_main, engine.saved_bytes, asynchronous)

        def on_written(records: dict) -> None:
            mine = {os.path.relpath(path, tag_dir): rec for path, rec in records.items()}
            atomic_write_text(tag_dir / MARKER.format(rank), json.dumps(mine))
            if is_main:
                commit(self.ckpt_dir, tag, world, self.keep, self.record, meta, self.derived_dirs)

        try:
            in_background = engine.save(tag_dir, client_state, on_written=on_written, on_failed=failed)
        except Exception as exc:
            err = failed(exc)
            if err is exc:
                raise
            raise err from exc
        if distributed and not in_background:
            dist.barrier()  # sync: when save returns on any rank, `latest` names this checkpoint
        return tag

    def wait(self, engine) -> None:
        """Block until this rank's save in flight is written (rank 0: and committed)."""
        engine.wait_for_saves()
