"""What a ``data.prefixes`` entry names: one shard (``P.bin/.idx``), a shard set (``P_00000`` ...) or a
shard manifest (``P.manifest.json``, written by ``megafixed preprocess --submit``). Its own module so
that the dataset builder and the multi-node preprocessing (which writes manifests) both read it
without importing each other."""
from __future__ import annotations

import glob
import json
import os

from .errors import DataError
from .indexed import bin_path, idx_path, shard_exists

MANIFEST_FORMAT = "megafixed-shard-manifest"
MANIFEST_SUFFIX = ".manifest.json"


def resolve_prefix(prefix: str) -> list[str]:
    """A prefix names one shard (``P.bin/.idx``), a set written with ``--shard-size-mb`` (``P_00000`` ...),
    or a ``P.manifest.json`` written by ``preprocess --submit`` (its shards, in order)."""
    if prefix.endswith(".json") and os.path.isfile(prefix):
        return read_manifest(prefix)
    if shard_exists(prefix):
        return [prefix]
    shards = sorted(p[: -len(".idx")] for p in glob.glob(glob.escape(prefix) + "_[0-9][0-9][0-9][0-9][0-9].idx"))
    if shards:
        return shards
    raise DataError(f"no shards for data prefix {prefix!r} (looked for {prefix}.bin/.idx and {prefix}_00000.idx); "
                    f"run `megafixed preprocess --output-prefix {prefix} ...` or fix data.prefixes")


def read_manifest(path: str) -> list[str]:
    """A manifest's shard prefixes (absolute; stored relative to the manifest's folder), each checked."""
    try:
        with open(path) as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read shard manifest {path} ({exc}); rewrite it with `megafixed preprocess "
                        f"... --submit`") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{path} is not a megafixed shard manifest (format {MANIFEST_FORMAT!r}); give a shard "
                        f"prefix or a PREFIX{MANIFEST_SUFFIX} written by `megafixed preprocess --submit`")
    root = os.path.dirname(os.path.abspath(path))
    out = []
    for entry in manifest.get("shards", []):
        p = os.path.join(root, entry["prefix"])
        if not (os.path.isfile(idx_path(p)) and os.path.isfile(bin_path(p))):
            raise DataError(f"shard {p} listed in manifest {path} is missing; re-run `megafixed preprocess ... "
                            f"--submit` (it redoes missing groups) or fix data.prefixes")
        out.append(p)
    if not out:
        raise DataError(f"shard manifest {path} lists no shard")
    return out
