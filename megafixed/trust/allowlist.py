"""The allow-lists: which globals the pickles of which checkpoint files may import.

Each ``allowlists/<name>.json`` is data read from one library version::

    {"library": "deepspeed", "version": "0.19.8",        # the installed version it was read from
     "files": ["*_model_states.pt", "*_optim_states.pt"],  # fnmatch patterns of the file names
     "globals": ["deepspeed.runtime.fp16.loss_scaler.LossScaler", ...]}

A file may import the union of the globals of every list whose patterns match its name.
``library`` "torch" lists are checked against torch's version, "deepspeed" against DeepSpeed's;
"megafixed" lists describe our own files (no version to compare). A test fails when the installed
version differs from the one a list was read from, so a library upgrade re-reads its list.
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent / "allowlists"


@dataclass(frozen=True)
class AllowList:
    name: str  # the file's stem
    library: str
    version: str
    files: tuple[str, ...]
    globals: frozenset[str]

    def covers(self, file_name: str) -> bool:
        return any(fnmatch.fnmatchcase(file_name, pattern) for pattern in self.files)


def allow_lists(folder: Path = HERE) -> list[AllowList]:
    out = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        out.append(AllowList(path.stem, data["library"], str(data.get("version", "")), tuple(data["files"]),
                             frozenset(data["globals"])))
    return out


def allowed_globals(file_name: str, lists=None) -> frozenset[str]:
    """Every global a pickle named ``file_name`` may import."""
    lists = allow_lists() if lists is None else lists
    return frozenset().union(*(a.globals for a in lists if a.covers(file_name)))


def pickled_file(file_name: str, lists=None) -> bool:
    """Whether some list describes ``file_name`` (so it is a pickle that a loader will read)."""
    lists = allow_lists() if lists is None else lists
    return any(a.covers(file_name) for a in lists)
