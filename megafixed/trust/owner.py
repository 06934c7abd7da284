"""Whose run directory: ssh's rule for ``~/.ssh``, applied to what a reader will load.

A run directory, its ``checkpoints/``, ``latest`` and the checkpoints in it (each tag directory and
its files) must be owned by the user who reads them (or root) and not writable by group or others:
otherwise someone else could have put a checkpoint there (a predictable path in a shared ``/tmp``,
a group scratch), and reading it would resume their run as ours. Such a place is refused before
anything in it is read, in one line naming the path, its owner and mode, and the fix.

Group-writable is accepted for a user-private group (the group named like the owner, with no
other member: the Debian/Ubuntu ``umask 002`` convention), where "group" means the owner only.
A directory shared by a real group (setgid, mode 2770) is trusted knowingly: ``train.trust_run_dir=true``
or ``--trust-run-dir`` on the reading verbs (docs/security.md).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterator, Optional, Union

from .errors import UntrustedRunDirectory

CHECKPOINTS = "checkpoints"  # run_dir.CHECKPOINTS (not imported: run/ imports this module)


def _name_of_uid(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _private_group(st: os.stat_result) -> bool:
    """The file's group is its owner's user-private group (same name, no other member)."""
    import grp

    try:
        group = grp.getgrgid(st.st_gid)
    except KeyError:
        return False
    owner = _name_of_uid(st.st_uid)
    return group.gr_name == owner and set(group.gr_mem) <= {owner}


def why_untrusted(path: Path, st: Optional[os.stat_result] = None) -> Optional[str]:
    """Why ``path`` is not safe to read as ours (None: it is)."""
    st = st or os.lstat(path)
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"is owned by {_name_of_uid(st.st_uid)}, not by you ({_name_of_uid(me)})"
    if stat.S_ISLNK(st.st_mode):
        return None  # a link's own mode means nothing; where it leads is checked where it is followed
    if st.st_mode & stat.S_IWOTH:
        return f"is writable by every user (mode {stat.filemode(st.st_mode)})"
    if st.st_mode & stat.S_IWGRP and not _private_group(st):
        return f"is writable by its group (mode {stat.filemode(st.st_mode)})"
    return None


def _checkpoint_paths(root: Path) -> Iterator[Path]:
    """``root`` and everything under it, links not followed (a checkpoints folder or a tag directory)."""
    yield root
    for parent, dirs, files in os.walk(root):
        for name in sorted(dirs) + sorted(files):
            yield Path(parent) / name


def places_to_check(path: Union[str, os.PathLike]) -> list[Path]:
    """The existing run directory, its ``checkpoints/`` with everything in it, for ``path``: a run
    directory, its checkpoints folder, a tag directory, or a folder of tags (a conversion's output)."""
    p = Path(path)
    if not p.exists():
        return []
    if (p / CHECKPOINTS).is_dir():
        run, ckpts = p, p / CHECKPOINTS
    elif p.name == CHECKPOINTS:
        run, ckpts = p.parent, p
    elif p.parent.name == CHECKPOINTS:
        run, ckpts = p.parent.parent, p.parent
    else:
        run, ckpts = None, p  # a checkpoint outside a run: the folder itself and what it holds
    out = [run] if run is not None else []
    return out + (list(_checkpoint_paths(ckpts)) if ckpts.is_dir() else [ckpts])


def check_run_dir(path: Union[str, os.PathLike], *, trusted: bool = False, flag: str = "--trust-run-dir") -> None:
    """Refuse (``UntrustedRunDirectory``) a run directory, or a checkpoint in it, that someone else
    owns or can write; ``trusted``: accepted knowingly (``flag`` names how the user says so)."""
    if trusted:
        return
    for place in places_to_check(path):
        try:
            why = why_untrusted(place)
        except FileNotFoundError:  # removed meanwhile (a rotation): nothing of it will be read
            continue
        if why:
            raise UntrustedRunDirectory(
                f"{place} {why}: someone else could have put a checkpoint there, so nothing in it was read. "
                f"If it is yours, fix it (chown/chmod go-w on it); if it is shared on purpose and you trust "
                f"whoever can write it, pass {flag}")
