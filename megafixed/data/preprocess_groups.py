"""Preprocessing on many machines: input-file groups, one shard set per group, and one manifest.

A corpus of trillions of tokens is split into groups of whole input files, contiguous in input
order and balanced by bytes (:func:`plan_groups`); each group is tokenized independently
(:func:`run_group`, one Slurm array task) into its own shard set ``PREFIX_gNNNNN``; then
:func:`write_manifest` lists every group's shards with their token and document counts in
``PREFIX.manifest.json``, which ``data.prefixes`` accepts as it is (no merge copy).

Because groups are contiguous, the manifest's documents in order are exactly those of one
single-process run over all inputs. A group counts as done only with its ``.done.json`` record,
written after its shards were renamed into place and re-opened (validated), and matching the plan
and the inputs' sizes and mtimes; a rerun skips such groups and redoes the rest. A killed task leaves
temporary files only (never a half shard), and the next run of that group removes them.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Optional

from ..atomic import atomic_write_text
from .errors import DataError
from .indexed import IndexedShard
from .prefixes import MANIFEST_FORMAT, MANIFEST_SUFFIX, resolve_prefix


def manifest_path(prefix: str) -> str:
    return prefix + MANIFEST_SUFFIX


def plan_path(prefix: str) -> str:
    return prefix + ".plan.json"


def group_prefix(prefix: str, index: int) -> str:
    return f"{prefix}_g{index:05d}"


def done_path(prefix: str, index: int) -> str:
    return group_prefix(prefix, index) + ".done.json"


def plan_groups(paths: list[str], groups: int) -> list[list[str]]:
    """Cut the files, in order, into at most ``groups`` contiguous runs of about equal bytes."""
    if groups < 1:
        raise DataError(f"--nodes/--groups {groups} must be >= 1")
    sizes = [os.path.getsize(p) for p in paths]
    total, n = sum(sizes), min(groups, len(paths))
    out: list[list[str]] = [[] for _ in range(n)]
    seen, g = 0, 0
    for i, (p, s) in enumerate(zip(paths, sizes)):
        # move on once this group holds its share, keeping one file for every group still to fill
        if out[g] and g < n - 1 and (seen + s / 2 > total * (g + 1) / n or len(paths) - i <= n - 1 - g):
            g += 1
        out[g].append(p)
        seen += s
    return [grp for grp in out if grp]


def _stamp(path: str) -> list:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def make_plan(prefix: str, paths: list[str], groups: int, options: dict) -> dict:
    """The job's plan: groups of input files (with sizes/mtimes) and the preprocess options."""
    return {"prefix": os.path.abspath(prefix), "options": options,
            "groups": [[_stamp(p) for p in grp] for grp in plan_groups(paths, groups)]}


def plan_digest(plan: dict) -> str:
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


def load_plan(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read preprocessing plan {path} ({exc}); re-run `megafixed preprocess ... "
                        f"--submit`") from exc


def group_shards(prefix: str, index: int) -> list[str]:
    return resolve_prefix(group_prefix(prefix, index))


def verify_group(plan: dict, index: int) -> Optional[str]:
    """None when group ``index`` is complete and verified, else why not (one phrase)."""
    prefix = plan["prefix"]
    try:
        with open(done_path(prefix, index)) as fh:
            done = json.load(fh)
    except (OSError, ValueError):
        return "has no completed shard (its task did not finish)"
    if done.get("plan") != plan_digest(plan):
        return "was written for another plan (other inputs, tokenizer or options)"
    for path, size, mtime in plan["groups"][index]:
        try:
            if _stamp(path)[1:] != [size, mtime]:
                return f"input {path} changed since it was tokenized"
        except OSError:
            return f"input {path} is gone"
    try:
        shards = [IndexedShard(p) for p in group_shards(prefix, index)]
    except DataError as exc:
        return f"has a broken shard ({exc})"
    got = [[os.path.basename(s.prefix), s.num_documents, s.num_tokens] for s in shards]
    if got != done.get("shards"):
        return f"shards {got} do not match its completion record {done.get('shards')}"
    return None


def group_has_shards(prefix: str, index: int) -> bool:
    """Whether finished shard files of the group exist (temp files of a killed task do not count)."""
    base = glob.escape(group_prefix(prefix, index))
    return any(glob.glob(base + pat) for pat in (".idx", ".bin", "_[0-9][0-9][0-9][0-9][0-9].idx"))


def clean_group(prefix: str, index: int) -> None:
    """Remove a group's shards, completion record and any temp files a killed task left."""
    base = glob.escape(group_prefix(prefix, index))
    for p in glob.glob(base + ".*") + glob.glob(base + "_[0-9][0-9][0-9][0-9][0-9].*"):
        os.remove(p)


def run_group(plan: dict, index: int, preprocess_fn) -> dict:
    """Tokenize group ``index`` into its own shard set, then write its completion record."""
    if not 0 <= index < len(plan["groups"]):
        raise DataError(f"group {index} is not in the plan ({len(plan['groups'])} groups)")
    prefix = plan["prefix"]
    clean_group(prefix, index)  # a killed earlier try leaves temp files only; never build on them
    report = preprocess_fn([p for p, _, _ in plan["groups"][index]], group_prefix(prefix, index))
    shards = [IndexedShard(p) for p in group_shards(prefix, index)]  # re-open: validated before "done"
    record = {"plan": plan_digest(plan), "group": index, "documents": report.documents, "tokens": report.tokens,
              "shards": [[os.path.basename(s.prefix), s.num_documents, s.num_tokens] for s in shards]}
    atomic_write_text(done_path(prefix, index), json.dumps(record, indent=1))
    return record


def write_manifest(plan: dict) -> dict:
    """Verify every group and write the manifest; refuse, naming them, if any group is missing."""
    prefix = plan["prefix"]
    missing = [(i, why) for i in range(len(plan["groups"])) if (why := verify_group(plan, i)) is not None]
    if missing:
        named = "; ".join(f"group {i} ({', '.join(os.path.basename(p) for p, _, _ in plan['groups'][i][:3])}"
                          f"{' ...' if len(plan['groups'][i]) > 3 else ''}) {why}" for i, why in missing)
        raise DataError(f"no manifest written: {named}; re-run the same `megafixed preprocess ... --submit` "
                        f"to redo only the missing groups")
    shards, meta = [], {}
    for i in range(len(plan["groups"])):
        for p in group_shards(prefix, i):
            s = IndexedShard(p)
            meta = meta or s.meta()
            shards.append({"prefix": os.path.basename(p), "group": i, "documents": s.num_documents,
                           "tokens": s.num_tokens})
    manifest = {"format": MANIFEST_FORMAT, "version": 1, "shards": shards,
                "documents": sum(s["documents"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
                **{k: meta.get(k) for k in ("tokenizer", "tokenizer_sha256", "vocab_size", "eod_id", "dtype",
                                            "append_eod")}}
    atomic_write_text(manifest_path(prefix), json.dumps(manifest, indent=1))
    return manifest
