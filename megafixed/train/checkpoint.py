"""Checkpoints: DeepSpeed writes the shards, we own the ``latest`` pointer.

Layout: ``<run_dir>/checkpoints/step_00000100/`` (DeepSpeed's files for that step) and
``<run_dir>/checkpoints/latest`` (one line: the tag). DeepSpeed's own ``latest`` is written
before every rank has finished its shards; ours is written by rank 0 after a barrier, via a
temporary file and ``os.replace``, so a crash mid-save leaves ``latest`` on the previous,
complete checkpoint.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..atomic import atomic_write_text

LATEST = "latest"
TAG_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message says why and what to change."""


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def tag_step(tag: str) -> int:
    m = TAG_RE.match(tag)
    return int(m.group(1)) if m else -1


def read_latest(ckpt_dir: str | os.PathLike) -> Optional[str]:
    path = Path(ckpt_dir) / LATEST
    if not path.exists():
        return None
    tag = path.read_text(errors="replace").strip()
    if not tag:
        raise CheckpointError(f"{path} is empty; write the tag to resume from into it (one of: "
                              f"{', '.join(_tags(ckpt_dir)) or 'none found'}), or delete it to start from scratch")
    if not (Path(ckpt_dir) / tag).is_dir():
        raise CheckpointError(f"{path} points to '{tag}', which does not exist under {ckpt_dir}; "
                              f"restore that directory or delete {path} to start from scratch")
    return tag


def write_latest(ckpt_dir: str | os.PathLike, tag: str) -> None:
    atomic_write_text(Path(ckpt_dir) / LATEST, tag + "\n")


def _tags(ckpt_dir) -> list[str]:
    root = Path(ckpt_dir)
    return sorted(p.name for p in root.iterdir() if p.is_dir() and TAG_RE.match(p.name)) if root.is_dir() else []


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
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng_states() -> list[dict]:
    """Every rank's RNG state, so the (rank-0-written) client state can restore all of them."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [rng_state()]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, rng_state())
    return out


# ----------------------------------------------------------------------------------- save / load
def save(engine, ckpt_dir: str | os.PathLike, step: int, client_state: dict, keep: int, is_main: bool,
         run_record: Optional[dict] = None) -> str:
    """DeepSpeed's shards, then (rank 0) the run record, then ``latest``: a crash at any point
    leaves ``latest`` on the previous complete checkpoint."""
    from .resume import write_run_record

    tag = tag_for(step)
    client_state = {**client_state, "rng": gather_rng_states()}
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    if dist.is_initialized():
        dist.barrier()  # every rank's shards are on disk before anyone points `latest` at them
    if is_main:
        if run_record is not None:
            write_run_record(Path(ckpt_dir) / tag, run_record)
        write_latest(ckpt_dir, tag)
        prune(ckpt_dir, keep, protect=tag)
    if dist.is_initialized():
        dist.barrier()
    return tag


def _summarize(msg: str, keep: int = 3) -> str:
    """torch's load_state_dict error lists every tensor on its own line; keep one line and the first few."""
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    more = f" (+{len(lines) - keep} more)" if len(lines) > keep else ""
    return " ".join(lines[:keep]) + more


def load(engine, ckpt_dir: str | os.PathLike, rank: int) -> Optional[dict]:
    """Restore model, optimizer and RNG from ``latest``; returns the client state (None: nothing to load)."""
    tag = read_latest(ckpt_dir)
    if tag is None:
        return None
    try:
        path, client = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
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
