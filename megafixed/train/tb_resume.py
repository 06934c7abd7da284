"""TensorBoard event files after a resume: drop what the interrupted run logged past its checkpoint.

A run killed after step N's checkpoint may have logged steps N+1.. before it died; the resumed run
logs those steps again. ``metrics.jsonl`` is cut back to step N on resume (``MetricsLog``); the event
files must be too, or every reader that does not implement TensorBoard's purge rule (tbparse, pandas
exports, W&B's ``sync_tensorboard``, the event loader itself) sees each of those steps twice, out of
order. ``SummaryWriter(purge_step=...)`` only writes a marker that TensorBoard's own UI honours, so the
files are rewritten here: each event file keeping only events at steps <= N (plus the step-less
header records), written beside it and moved over it atomically.
"""
from __future__ import annotations

import os
from pathlib import Path


def _keeps(event, resume_step: int) -> bool:
    # Header records (file_version) and session logs carry no scalar; keep them as they are.
    if not event.HasField("summary"):
        return True
    return event.step <= resume_step


def truncate_events_after(tb_dir: str | os.PathLike, resume_step: int) -> int:
    """Rewrite the event files under ``tb_dir`` without events past ``resume_step``; returns how many
    events were dropped. Files with nothing to drop are not touched."""
    tb_dir = Path(tb_dir)
    if not tb_dir.is_dir():
        return 0
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    dropped = 0
    for path in sorted(tb_dir.rglob("events.out.tfevents.*")):
        if path.name.endswith(".tmp"):
            continue
        records = list(RawEventFileLoader(str(path)).Load())  # raw bytes: rewritten exactly as read
        keep = [r for r in records if _keeps(event_pb2.Event.FromString(r), resume_step)]
        if len(keep) == len(records):
            continue
        dropped += len(records) - len(keep)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            writer = RecordWriter(fh)
            for r in keep:
                writer.write(r)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    return dropped
