"""Per-checkpoint manifest: what a checkpoint holds, and proof that its files are intact.

``<tag>/manifest.json`` is written by rank 0 after every rank's files are on disk and before
``latest`` moves; it lists every file with its size and sha256 (computed from the bytes as they
were written, see ``async_save.CheckpointWriter``), plus the layout, the step, the tokens seen, the
input interface and its fixed code (A's rows and b for gf2), the parameter count and the git
revision of the megafixed source that trained it.

``verify`` re-reads the files (spread over the ranks) and names the first one that is missing,
has the wrong size or the wrong checksum. ``verify_for_reading`` is the check every reader runs
before it uses a tensor (resume, eval, export, generate, probe, convert, ``init_from``, universal
conversion, ``ckpt inspect``): a checkpoint with a run record but no manifest was written by a
megafixed that writes manifests, so its manifest was lost and it is refused; one with neither
(a DeepSpeed folder written by another tool, ``megafixed convert``'s input) is read with a one-line warning. Then every
pickle a loader will unpickle is scanned (``megafixed.trust.pickles.check_tag_dir``): a global outside
the allow-lists is refused in one line naming the file and the global (the manifest is no defence: whoever
can write the files can rewrite it). A manifest entry naming a path outside its tag directory is damage.

Cost: hashing is streamed (8 MiB chunks) on a few threads (hashlib and file reads release the
GIL); the measured rate and what it means for a 1.7B checkpoint are in docs/benchmarks.md.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

from ..atomic import atomic_write_text
from ..trust.pickles import check_tag_dir
from .checkpoint_error import DamagedCheckpoint
from .run_dir import LATEST, MANIFEST, RUN_RECORD, CheckpointError

FORMAT = 1
CHUNK = 8 << 20
HASH_THREADS = 4


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def git_revision() -> str:
    """``git rev-parse HEAD`` of the tree this megafixed was imported from ("unknown" if none)."""
    src = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    rev = out.stdout.strip()
    return rev if out.returncode == 0 and len(rev) >= 7 else "unknown"


def describe(cfg, layout: dict, step: int, consumed_samples: int) -> dict:
    """Everything but the files: what ``ckpt inspect`` shows without opening a tensor."""
    from ..config import resolve_code
    from ..model.interfaces import interface_of
    from ..model.params import count_params

    m = resolve_code(cfg).model
    code = interface_of(m).describe(m)
    return {"format": FORMAT, "step": step, "consumed_samples": consumed_samples,
            "consumed_tokens": consumed_samples * cfg.data.seq_len, "layout": dict(layout), "code": code,
            "parameters": count_params(cfg.model).total, "git_revision": git_revision()}


def derived(src_tag_dir: Path, layout: dict, **extra) -> tuple[dict, Optional[dict]]:
    """Manifest meta and run record for a checkpoint made from ``src_tag_dir``'s weights on another
    ``layout`` (``megafixed convert``): the source's step, tokens, code and config carry over, the
    layout and git revision are the new ones. The run record is None when the source has none."""
    from ..config import config_from_dict
    from .run_dir import tag_step
    from .run_record import read_run_record

    src_tag_dir = Path(src_tag_dir)
    src = read(src_tag_dir) or {}
    record = read_run_record(src_tag_dir)
    step = src.get("step", max(tag_step(src_tag_dir.name), 0))
    consumed = src.get("consumed_samples", 0)
    if record and record.get("config"):
        meta = describe(config_from_dict(record["config"]), layout, step, consumed)
        new_record = {**record, "layout": dict(layout), "format": FORMAT, **extra}
    else:
        meta = {"format": FORMAT, "step": step, "layout": dict(layout), "git_revision": git_revision(),
                **{k: src[k] for k in ("consumed_samples", "consumed_tokens", "code", "parameters") if k in src}}
        new_record = None
    return {**meta, **extra}, new_record


def progress(step: int, consumed_samples: int, seq_len: int) -> dict:
    return {"step": step, "consumed_samples": consumed_samples, "consumed_tokens": consumed_samples * seq_len}


def write(tag_dir: Path, meta: dict, files: dict[str, dict], tag: Optional[str] = None) -> dict:
    """``files``: name (relative to ``tag_dir``) -> {"size", "sha256"}; ``tag``: the name the directory
    will have (default: its name now; a writer that renames a temporary directory into place says)."""
    manifest = {**meta, "tag": tag or Path(tag_dir).name,
                "files": [{"name": n, **files[n]} for n in sorted(files)]}
    atomic_write_text(Path(tag_dir) / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def read(tag_dir: Path) -> Optional[dict]:
    path = Path(tag_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DamagedCheckpoint(f"{path} is unreadable ({exc}); the checkpoint is damaged: point "
                                f"{Path(tag_dir).parent / LATEST} at an earlier tag", why="manifest") from None


def check_file(tag_dir: Path, entry: dict, checksum: bool = True) -> Optional[str]:
    """Why the manifest's ``entry`` does not match the file on disk, or None."""
    if not inside(tag_dir, entry.get("name")):
        return f"named '{entry.get('name')}' in the manifest, outside the checkpoint directory"
    path = Path(tag_dir) / entry["name"]
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"{size} bytes on disk, {entry['size']} in the manifest (truncated or overwritten)"
    if checksum and sha256_file(path) != entry["sha256"]:
        return "its sha256 differs from the manifest's (corrupt)"
    return None


def inside(tag_dir: Path, name) -> bool:
    """Whether the manifest entry ``name`` is a relative path that stays inside ``tag_dir`` (no ``..``,
    not absolute, no symbolic link leading out): a manifest names files of its own checkpoint only."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        return False
    root = Path(tag_dir).resolve()
    return Path(root, name).resolve().is_relative_to(root)


def problems(tag_dir: Path, manifest: dict, rank: int = 0, world: int = 1, checksum: bool = True,
             only: Optional[Callable[[str], bool]] = None) -> list:
    """(index, name, why) for this rank's share of the files that fail their check (``only``: just
    the files whose name it accepts; a file it accepts that is on disk but not in the manifest fails too)."""
    mine = [(i, e) for i, e in enumerate(manifest["files"]) if i % world == rank and (only is None or only(e["name"]))]
    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(mine)))) as pool:
        whys = list(pool.map(lambda ie: check_file(tag_dir, ie[1], checksum), mine))
    out = [(i, e["name"], why) for (i, e), why in zip(mine, whys) if why]
    if only is not None and rank == 0:
        listed = {e["name"] for e in manifest["files"]}
        extra = sorted(p.name for p in Path(tag_dir).iterdir() if p.is_file() and only(p.name) and p.name not in listed)
        out += [(len(listed) + k, name, "not listed in the manifest (added after the save)")
                for k, name in enumerate(extra)]
    return out


def verify(tag_dir: Path, rank: int = 0, world: int = 1, group=None,
           only: Optional[Callable[[str], bool]] = None) -> Optional[dict]:
    """Raise ``CheckpointError`` naming the first bad file (all ranks together when ``world > 1``:
    each checks every ``world``-th file); return the manifest (None: a checkpoint without one)."""
    manifest = read(tag_dir)
    if manifest is None:
        return None
    bad = problems(tag_dir, manifest, rank, world, only=only)
    if world > 1:
        import torch.distributed as dist

        gathered: list = [None] * world
        dist.all_gather_object(gathered, bad, group=group)
        bad = sorted(p for part in gathered for p in part)
    if bad:
        _, name, why = bad[0]
        more = f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""
        what = (f"{Path(tag_dir) / name} is {why}" if why == "missing" else f"an entry {why}" if "outside" in why
                else f"{Path(tag_dir) / name}: {why}")
        raise DamagedCheckpoint(f"checkpoint {tag_dir} is damaged: {what}{more}. Point {Path(tag_dir).parent / LATEST} "
                                f"at an earlier tag (or delete it to start from scratch)", why=_one_word(why))
    return manifest


def _one_word(why: str) -> str:
    """The kind of damage ``check_file`` found, as one word (for the name a damaged tag is moved aside under)."""
    for word in ("missing", "truncated", "corrupt"):
        if word in why:
            return word
    if "outside" in why:
        return "outside"
    return "unlisted" if "not listed" in why else "damaged"


def warn(line: str) -> None:
    if os.environ.get("RANK", "0") in ("", "0"):
        print(line, file=sys.stderr, flush=True)


def verify_for_reading(tag_dir, *, only: Optional[Callable[[str], bool]] = None, rank: int = 0, world: int = 1,
                       group=None, warn: Callable[[str], None] = warn) -> Optional[dict]:
    """The check every reader runs before using a tensor of ``tag_dir`` (``only``: the files it will
    open, e.g. ``megafixed.engine.is_model_file``). Returns the manifest, or None for a checkpoint with neither
    manifest nor run record -- a DeepSpeed folder written by another tool (``megafixed convert``'s input), which
    megafixed reads without a checksum check -- after passing its one-line warning to ``warn`` (readers pass
    a list's ``append`` and print it once the files were read, so a failed read still ends in one ``error:`` line)."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        raise CheckpointError(f"checkpoint {tag_dir} does not exist")
    if (tag_dir / MANIFEST).exists():
        manifest = verify(tag_dir, rank, world, group, only=only)
        check_tag_dir(tag_dir)
        return manifest
    if (tag_dir / RUN_RECORD).exists():
        raise CheckpointError(f"checkpoint {tag_dir} has a run record ({RUN_RECORD}) but no {MANIFEST}: it was "
                              f"written by a megafixed that writes manifests, so its manifest was deleted or lost "
                              f"and its files cannot be checked. Restore {tag_dir / MANIFEST}, or point "
                              f"{tag_dir.parent / LATEST} at an earlier tag (--tag for the reading verbs)")
    warn(f"warning: {tag_dir} has no {MANIFEST} (not written by megafixed); its files are read "
         f"without a checksum check")
    check_tag_dir(tag_dir)
    return None


def file_record(path: Path, size: int, digest: str) -> dict:
    return {"size": size, "sha256": digest}


def record_existing(path: Path) -> dict:
    return file_record(path, os.path.getsize(path), sha256_file(path))
