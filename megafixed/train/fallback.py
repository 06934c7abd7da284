"""A damaged checkpoint does not stop an unattended run (``checkpoint.fallback``, on by default).

When the checkpoint a resume, a requeue or a rollback would load fails verification (a file missing,
truncated or corrupt against its manifest, or the manifest unreadable: ``run.checkpoint_error.
DamagedCheckpoint``), the newest older checkpoint that verifies is loaded instead, and the damaged
ones above it are moved aside within ``checkpoints/`` as ``<tag>.damaged-<why>`` -- never deleted,
and out of reach of rotation and of a later save of the same step. ``latest`` is moved first (a kill
in between leaves it on the verified tag). It is said in one line, in every later checkpoint's run
record (``fallbacks``) and in ``<run_dir>/faults/damaged_checkpoints.jsonl``.

When none verifies nothing is moved: one line names each checkpoint and its damage, exit 2. So is a
checkpoint that cannot be checked at all (a run record without its manifest): that needs a person.
``checkpoint.fallback=false`` keeps the strict behaviour: the first damaged checkpoint stops the
run in one line, and nothing is moved.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..run import manifest
from ..run.checkpoint_error import CheckpointError, DamagedCheckpoint
from ..run.run_dir import tag_step

FILE = "damaged_checkpoints.jsonl"  # under <run_dir>/faults/


@dataclass
class Damaged:
    tag: str
    why: str  # one word: missing, truncated, corrupt, manifest, ...
    detail: str  # the verifier's words

    @property
    def aside(self) -> str:
        return f"{self.tag}.damaged-{self.why}"


def newest_verified(rd, tag: str, *, rank: int, world: int, strict: bool, below: bool = False) -> tuple:
    """(the tag to load, the damaged tags passed over, newest first): ``tag`` itself if it verifies (or,
    ``below``, the newest tag under it), else the newest older one that does. Nothing is moved here.
    Every rank verifies its share of each candidate's files together (``manifest.verify``)."""
    older = sorted((t for t in rd.tags() if tag_step(t) < tag_step(tag)), key=tag_step, reverse=True)
    candidates = older if below else [tag, *older]
    damaged: list[Damaged] = []
    for candidate in candidates:
        try:
            manifest.verify_for_reading(rd.tag_dir(candidate), rank=rank, world=world)
        except DamagedCheckpoint as exc:
            if strict:
                raise
            damaged.append(Damaged(candidate, exc.why, str(exc).partition(". Point ")[0]))
            continue
        return candidate, damaged
    if not damaged:
        return None, []
    raise CheckpointError(f"no checkpoint of {rd.path} verifies: " + "; ".join(d.detail for d in damaged)
                          + ". Nothing was moved. Restore one of them (a copy kept elsewhere), or start a new run "
                          "with another train.run_dir")


def set_aside(rd, damaged: list, loaded: str, *, is_main: bool, world: int, when: str, say) -> list[dict]:
    """Move ``damaged`` aside (rank 0), ``latest`` onto ``loaded`` first; say it in one line. Returns the
    run-record entries (``fallbacks``)."""
    if not damaged:
        return []
    entries = [{"tag": d.tag, "why": d.why, "moved_to": d.aside, "loaded": loaded, "when": when} for d in damaged]
    if is_main:
        from ..atomic import atomic_write_text

        if _latest_name(rd) in {d.tag for d in damaged} | {None}:
            atomic_write_text(rd.latest_file, loaded + "\n")  # as the commit writes it
        for d, entry in zip(damaged, entries):
            dest, n = rd.checkpoints / d.aside, 1
            while dest.exists():  # the same step damaged twice in one run: keep both
                n += 1
                dest = rd.checkpoints / f"{d.aside}.{n}"
            os.rename(rd.tag_dir(d.tag), dest)
            entry["moved_to"] = dest.name
        rd.faults_dir.mkdir(parents=True, exist_ok=True)
        with open(rd.faults_dir / FILE, "a") as f:
            for d, entry in zip(damaged, entries):
                f.write(json.dumps({**entry, "detail": d.detail}) + "\n")
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # no rank reads the checkpoints before they are where they are now
    what = "; ".join(f"{d.detail}, moved aside to {rd.checkpoints / e['moved_to']}" for d, e in zip(damaged, entries))
    say(f"{what}. Loading {rd.tag_dir(loaded)} instead, the newest that verifies (checkpoint.fallback; "
        f"recorded in {rd.faults_dir / FILE})")
    return entries


def _latest_name(rd):
    try:
        return rd.latest_file.read_text().strip() or None
    except OSError:
        return None
