"""What a writing verb may write, decided before any work: the shared overwrite policy.

Every verb that writes (preprocess, data merge, tokenizer train, convert, ...) calls
:func:`claim_output` first and does its writing inside :func:`writing`. The rules, in order:

1. An output that is also one of the command's inputs is refused, even with ``--overwrite``:
   the command would replace what it reads (``data merge --inputs a b --output-prefix a``).
2. A run's live checkpoint directory (a ``latest`` file or ``step_*`` tags, or a run dir's
   ``checkpoints/``) is refused, even with ``--overwrite``: repointing ``latest`` there breaks
   the run's resume. Write beside it instead.
3. An existing output is refused unless ``--overwrite`` was given.

:func:`writing` removes, when the command fails, the output files it made and the folders that
did not exist before, so a failed command leaves the tree as it found it. (Files are replaced
through :mod:`megafixed.atomic`, so an ``--overwrite`` that fails keeps the old version.)
"""
from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterable, Iterator, Optional

from .run.run_dir import CHECKPOINTS, CONFIG, LATEST, METRICS
from .run.run_dir import TAG_RE as STEP_TAG


class OutputError(ValueError):
    """An output the command must not write; the message names it and the way out."""


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(path))))


def is_live_checkpoint_dir(path: str) -> bool:
    """A training run's checkpoint root: ``step_*`` tags or a ``latest`` naming one, or ``<run>/checkpoints``.
    (The output of ``convert`` has ``latest -> converted`` and may be replaced with --overwrite.)"""
    if not os.path.isdir(path):
        return False
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        try:
            with open(latest, errors="replace") as fh:
                if STEP_TAG.match(fh.read().strip()):  # a run's pointer (a conversion's says "converted")
                    return True
        except OSError:
            return True
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if any(STEP_TAG.match(n) and os.path.isdir(os.path.join(path, n)) for n in names):
        return True
    parent = os.path.dirname(_real(path))
    return os.path.basename(_real(path)) == CHECKPOINTS and any(
        os.path.exists(os.path.join(parent, n)) for n in (CONFIG, METRICS))


def _inside_live_checkpoint(path: str) -> Optional[str]:
    """The live checkpoint dir that ``path`` is, holds (a file such as its ``latest``), or a tag
    directory of, or a file inside one of its tags: writing any of these corrupts a resume."""
    real = _real(path)
    parent = os.path.dirname(real)
    for candidate in (real, parent, os.path.dirname(parent)):
        if is_live_checkpoint_dir(candidate):
            between = os.path.relpath(real, candidate).split(os.sep)
            # the root itself, a file or tag right inside it, or a file inside one of its step_* tags
            if between == ["."] or len(between) == 1 or STEP_TAG.match(between[0]):
                return candidate
    return None


def claim_output(paths: Iterable[str], *, overwrite: bool = False, inputs: Iterable[str] = (),
                 what: str = "output", flag: str = "--overwrite") -> None:
    """Refuse, before any work, an output that would replace an input, a live checkpoint dir,
    or (without ``overwrite``) anything that exists. ``paths`` lists every file or folder the
    command will write; ``inputs`` every file or folder it reads."""
    paths = [os.fspath(p) for p in paths]
    ins = {_real(p): os.fspath(p) for p in inputs}
    for p in paths:
        real = _real(p)
        live = _inside_live_checkpoint(p)
        if live:
            raise OutputError(f"{what} {p} is a training run's live checkpoint directory ({live}); writing "
                              f"there would repoint or replace the checkpoints the run resumes from: write to "
                              f"a new folder instead (even {flag} does not allow this)")
        if real in ins:
            raise OutputError(f"{what} {p} is also an input of this command (as {ins[real]}); writing it would "
                              f"replace the input: choose another {what} path")
        for inp_real, inp in ins.items():
            if os.path.isdir(real) and inp_real.startswith(real.rstrip(os.sep) + os.sep):
                raise OutputError(f"{what} {p} contains the input {inp}; writing there could replace it: "
                                  f"choose another {what} folder")
    if overwrite:
        return
    for p in paths:
        if os.path.isdir(p) and not os.listdir(p):
            continue  # an empty folder the user made for this output holds nothing to lose
        if os.path.lexists(p):
            raise OutputError(f"{what} {p} already exists; pass {flag} to replace it, or choose another path")


def _missing_dirs(path: str) -> Optional[str]:
    """The topmost ancestor folder of ``path`` that does not exist yet (None if all exist)."""
    top = None
    d = os.path.dirname(os.path.abspath(path))
    while d and not os.path.exists(d):
        top = d
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return top


@contextlib.contextmanager
def writing(files: Iterable[str] = (), dirs: Iterable[str] = ()) -> Iterator[None]:
    """Run the write phase; on failure remove the ``files`` and ``dirs`` that did not exist before,
    and every parent folder made on their behalf. Nothing is created here: writers create their
    own parent folders just before writing (:func:`ensure_parent`)."""
    files, dirs = [os.fspath(f) for f in files], [os.fspath(d) for d in dirs]
    new_files = [f for f in files if not os.path.lexists(f)]
    new_dirs = [d for d in dirs if not os.path.lexists(d)]
    new_parents = {t for t in (_missing_dirs(p) for p in files + dirs) if t}
    try:
        yield
    except BaseException:
        for f in new_files:
            with contextlib.suppress(OSError):
                if os.path.isfile(f) or os.path.islink(f):
                    os.remove(f)
        for d in sorted(set(new_dirs) | new_parents, key=len, reverse=True):
            shutil.rmtree(d, ignore_errors=True)
        raise


def ensure_parent(path: str) -> None:
    """Create the folder that will hold ``path`` (call right before writing it)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


def check_prefix(prefix: str, flag: str = "--output-prefix") -> None:
    """A shard prefix names files (PREFIX.bin), not a folder: ``out/`` would write hidden ``out/.bin``."""
    if not prefix or prefix.endswith(("/", os.sep)) or os.path.isdir(prefix) or os.path.basename(prefix) in (".", ".."):
        raise OutputError(f"{flag} {prefix!r} names a folder; give a file prefix inside it, e.g. "
                          f"{os.path.join(prefix.rstrip('/') or '.', 'corpus')} (writes corpus.bin/.idx/.meta.json "
                          f"there)")
