"""After a resume, TensorBoard's event files and the W&B run (offline) hold each step once, with the values
metrics.jsonl holds; the restart continues the same W&B run."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from _metrics import raw_scalars, read_metrics
from _train_data import tiny_overrides, write_shards
from megafixed.config import load_config

# An offline W&B run's run-<id>.wandb file is a LevelDB-style log (W&B's header, then 32 KiB blocks of
# CRC-framed chunks) of wandb_internal_pb2.Record protobufs; wandb 0.31 ships no Python reader for it.

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


def _train(prefix, run_dir, *extra):
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.trainer import train

    cfg = load_config(None, tiny_overrides(prefix, run_dir, "metrics.tensorboard=true", "wandb.enabled=true",
                                           "wandb.mode=offline", "wandb.project=megafixed-tests",
                                           "wandb.tags=[ci,resume]", *extra))
    return train(cfg, setup_distributed(RunPlan.for_launch(cfg)), log=lambda *_: None)


def test_a_resume_after_steps_logged_past_the_checkpoint_leaves_each_step_once(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: no network, whatever the config says
    monkeypatch.setenv("WANDB_SILENT", "true")
    prefix = write_shards(tmp_path / "shards")
    run_dir = tmp_path / "run"
    common = ("train.max_steps=4", "checkpoint.interval=2", "checkpoint.keep=0", "validation.interval=2")
    _train(prefix, run_dir, *common)
    # The run "died" after step 4's logs but before its checkpoint counted: latest still says step 2.
    (run_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    before = raw_scalars(run_dir / "tensorboard")
    assert [s for s, _ in before["train/loss"]] == [1, 2, 3, 4]
    resumed = _train(prefix, run_dir, *common)
    assert resumed.resumed_from == "step_00000002" and resumed.step == 4

    scalars = raw_scalars(run_dir / "tensorboard")
    recs = read_metrics(run_dir)
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("valid/val_loss", "val_loss")):
        steps = [s for s, _ in scalars[tag]]
        assert steps == sorted(set(steps)), f"{tag}: duplicate or out-of-order steps {steps}"
        want = [(r["step"], r[key]) for r in recs if key in r]
        assert [s for s, _ in want] == steps
        assert all(abs(v - w) <= 1e-6 * max(1.0, abs(w)) for (_, v), (_, w) in zip(scalars[tag], want, strict=True))
    assert [s for s, _ in scalars["valid/val_loss"]] == [0, 2, 4]

    # W&B: one run id for both segments; its history holds metrics.jsonl's values, each step once.
    run_id = json.loads((run_dir / "wandb_run.json").read_text())["id"]
    ids, rows = offline_history(run_dir / "wandb")
    assert ids == {run_id} and len(list((run_dir / "wandb").glob("offline-run-*"))) == 2
    logged = [(r["_step"], r["train/loss"]) for r in rows if "train/loss" in r]
    assert logged == [(r["step"], r["loss"]) for r in recs if "loss" in r]
    assert [r["_step"] for r in rows if "valid/val_loss" in r] == [0, 2, 4]


def test_train_wandb_without_the_package_is_one_error_naming_the_extra(monkeypatch, tmp_path):
    import importlib.util

    from megafixed.config import ConfigError
    from megafixed.train.wandb_log import WandbLog

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'megafixed\[wandb\]'"):
        WandbLog(load_config(None, ["wandb.enabled=true"]), tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written


def test_metrics_rewind_drops_the_records_and_events_past_the_step_it_went_back_to(tmp_path):
    """A rollback to step 3 after step 5 was logged: what was logged past 3 goes from metrics.jsonl and from
    TensorBoard, and the steps written again after it stand once, in order (one step numbering)."""
    from megafixed.train.metrics import MetricsLog

    log = MetricsLog(tmp_path, enabled=True, tensorboard=True)
    for step in range(1, 6):
        log.write({"step": step, "loss": float(step)})
    log.rewind(3)
    for step in (4, 5):
        log.write({"step": step, "loss": 10.0 * step})  # the steps computed again after the rollback
    log.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path, "loss")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    scalars = raw_scalars(tmp_path / "tensorboard")["train/loss"]
    # the raw events, as written: the rewound steps' old values are gone from the files, not only hidden
    assert [s for s, _ in scalars] == [1, 2, 3, 4, 5] and [v for _, v in scalars][3:] == [40.0, 50.0], scalars
