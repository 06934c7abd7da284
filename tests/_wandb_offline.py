"""Reading an offline W&B run's ``run-<id>.wandb`` file without a server.

The file is a LevelDB-style log (W&B's own header, then 32 KiB blocks of CRC-framed chunks) of
``wandb_internal_pb2.Record`` protobufs; wandb 0.31 ships no Python reader for it, so the tests read
it here with the protobuf classes wandb does ship.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7  # ":W&B" + magic (2) + version (1); chunk headers are 7 bytes too: crc32, length, type


def records(path: str | Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, buf = HEADER, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        buf += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def offline_history(wandb_dir: str | Path) -> tuple[set, list[dict]]:
    """(run ids, history rows) of every offline segment under ``wandb_dir``, in time order."""
    ids, rows = set(), []
    for path in sorted(Path(wandb_dir).glob("offline-run-*/run-*.wandb")):
        for rec in records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
            elif kind == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return ids, rows
