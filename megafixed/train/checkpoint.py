"""Checkpoints: DeepSpeed writes the shards, we own the ``latest`` pointer.

Layout: ``<run_dir>/checkpoints/step_00000100/`` (DeepSpeed's files for that step, ``run.json``,
``manifest.json``) and ``<run_dir>/checkpoints/latest`` (one line: the tag). DeepSpeed's own
``latest`` is written before every rank has finished its shards; ours is written by rank 0 only
after every rank reported its files written and fsynced (``MARKER``), their sizes checked and the
manifest written, via a temporary file and ``os.replace`` -- so a crash (kill -9) mid-save leaves
``latest`` on the previous, complete checkpoint. The files themselves go through
``async_save.CheckpointWriter`` (checksums as written; in the background with
``train.async_save=true``).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..atomic import atomic_write_text
from .run_dir import LATEST, TAG_RE, CheckpointError, read_latest  # noqa: F401 -- re-exported


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def tag_step(tag: str) -> int:
    m = TAG_RE.match(tag)
    return int(m.group(1)) if m else -1


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
def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        # This rank's own device only: a state per visible GPU (get_rng_state_all) cannot be restored
        # where fewer GPUs are visible (one per rank under Slurm/torchrun), and the others' are not ours.
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict) -> None:
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


# ----------------------------------------------------------------------------------- save / load
MARKER = ".files.rank{:05d}.json"  # a rank's written files, its signal that they are complete
COMMIT_TIMEOUT_S = 3600.0


def writer_of(engine, async_save: Optional[bool] = None):
    """The engine's ``CheckpointWriter`` (installed on first use; ``async_save`` switches the mode)."""
    from .async_save import CheckpointWriter

    writer = getattr(engine, "checkpoint_engine", None)
    if not isinstance(writer, CheckpointWriter):
        writer = CheckpointWriter(bool(async_save), getattr(engine, "_config", None))
        engine.checkpoint_engine = writer
    elif async_save is not None:
        writer.async_save = bool(async_save)
    return writer


def save(engine, ckpt_dir: str | os.PathLike, step: int, client_state: dict, keep: int, is_main: bool,
         run_record: Optional[dict] = None, meta: Optional[dict] = None) -> str:
    """DeepSpeed's shards (through our ``CheckpointWriter``), then -- once every rank's files are
    written -- the run record, the manifest and ``latest`` (rank 0). A crash at any point leaves
    ``latest`` on the previous complete checkpoint. With an async writer this returns while the
    files are still being written; the next ``save`` (or ``wait_for_saves``) waits for them."""
    tag = tag_for(step)
    tag_dir = Path(ckpt_dir) / tag
    writer = writer_of(engine)
    writer.begin()  # a save in flight completes first
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if is_main and tag_dir.exists() and _latest_or_none(ckpt_dir) != tag:
        shutil.rmtree(tag_dir)  # left by an interrupted save: its files must not mix with ours
    client_state = {**client_state, "rng": gather_rng_states()}
    if distributed:
        dist.barrier()

    def failed(exc: BaseException, asynchronous: bool = False) -> BaseException:
        # full disk / quota / permissions named; the partial tag removed; `latest` untouched
        from .save_faults import named
        return named(exc, Path(ckpt_dir), tag, is_main, writer.handed_bytes, asynchronous)

    def on_written(records: dict) -> None:
        mine = {os.path.relpath(path, tag_dir): rec for path, rec in records.items()}
        atomic_write_text(tag_dir / MARKER.format(rank), json.dumps(mine))
        if is_main:
            _commit(Path(ckpt_dir), tag, world, keep, run_record, meta or {})

    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
        writer.finish(on_written, on_failed=lambda exc: failed(exc, asynchronous=True))
    except Exception as exc:
        err = failed(exc)
        if err is exc:
            raise
        raise err from exc
    if distributed and not writer.async_save:
        dist.barrier()  # sync: when save returns on any rank, `latest` names this checkpoint
    return tag


def wait_for_saves(engine) -> None:
    """Block until this rank's save in flight is written (rank 0: and committed)."""
    from .async_save import CheckpointWriter

    writer = getattr(engine, "checkpoint_engine", None)
    if isinstance(writer, CheckpointWriter):
        writer.wait()


def _latest_or_none(ckpt_dir) -> Optional[str]:
    try:
        return read_latest(ckpt_dir)
    except CheckpointError:
        return None


def _commit(ckpt_dir: Path, tag: str, world: int, keep: int, run_record: Optional[dict], meta: dict) -> None:
    """Rank 0, after its own files: wait for every rank's, check them, write run record, manifest, latest."""
    from . import manifest
    from .resume import write_run_record

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
    if run_record is not None:
        write_run_record(tag_dir, run_record)
    hidden = {m.name for m in markers} | {manifest.MANIFEST}
    for path in sorted(tag_dir.rglob("*")):  # files written outside the engine (run.json, ...)
        rel = str(path.relative_to(tag_dir))
        if path.is_file() and rel not in files and path.name not in hidden and not rel.startswith("universal"):
            files[rel] = manifest.record_existing(path)
    manifest.write(tag_dir, {**meta, "tag": tag}, files)
    for m in markers:
        m.unlink()
    write_latest(ckpt_dir, tag)
    prune(ckpt_dir, keep, protect=tag)


def _summarize(msg: str, keep: int = 3) -> str:
    """torch's load_state_dict error lists every tensor on its own line; keep one line and the first few."""
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    more = f" (+{len(lines) - keep} more)" if len(lines) > keep else ""
    return " ".join(lines[:keep]) + more


def load(engine, ckpt_dir: str | os.PathLike, rank: int, universal: bool = False,
         tag: Optional[str] = None) -> Optional[dict]:
    """Restore model, optimizer and RNG from ``tag`` (default: ``latest``); returns the client state
    (None: nothing to load). The trainer passes the tag it read (once) and verified.

    ``universal``: read ``<tag>/universal`` (``universal.prepare``) with an engine built with
    ``checkpoint.load_universal`` -- the resume on another layout."""
    tag = tag or read_latest(ckpt_dir)
    if tag is None:
        return None
    load_dir, load_tag = (Path(ckpt_dir) / tag, "universal") if universal else (Path(ckpt_dir), tag)
    try:
        path, client = engine.load_checkpoint(str(load_dir), tag=load_tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
    except (RuntimeError, OSError) as exc:
        msg = str(exc)
        if isinstance(exc, OSError) or "PytorchStreamReader" in msg:  # a missing or truncated file, not a model change
            raise CheckpointError(f"cannot resume from {Path(ckpt_dir) / tag}: it is incomplete or corrupt "
                                  f"({_summarize(msg, keep=1)}); point {Path(ckpt_dir) / LATEST} at an earlier "
                                  f"tag, or delete it to start from scratch") from exc
        if "fixed code mismatch" in msg:
            lines = [ln.strip() for ln in msg.splitlines() if "fixed code mismatch" in ln]
            raise CheckpointError(f"cannot resume from {Path(ckpt_dir) / tag}: " + "; ".join(lines)) from None
        raise CheckpointError(f"cannot resume from {Path(ckpt_dir) / tag}: the checkpoint does not fit this "
                              f"model; set model.* back to the run's own {Path(ckpt_dir).parent / 'config.yaml'} "
                              f"or use a new train.run_dir. DeepSpeed said: {_summarize(msg)}") from exc
    if path is None:
        raise CheckpointError(f"DeepSpeed found no loadable checkpoint in {Path(ckpt_dir) / tag}")
    states = client.get("rng") or []
    if len(states) == (dist.get_world_size() if dist.is_initialized() else 1):
        set_rng_state(states[rank])
    elif states:
        # A different world size: RNG streams cannot map one to one; keep rank 0's, offset by rank.
        set_rng_state(states[0])
        torch.manual_seed(torch.initial_seed() + rank)
    return client
