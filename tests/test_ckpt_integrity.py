"""Checkpoint integrity: manifests, async saves, a kill -9 mid-save, and ``megafixed ckpt inspect``.

All through the real CLI (``python -m megafixed.cli train``), single process, tiny model, 4 steps.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _train_data import tiny_overrides, write_shards

ROOT = Path(__file__).resolve().parent.parent
TAG2, TAG4 = "step_00000002", "step_00000004"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("shards"))


def _cmd(shards, run_dir, *extra):
    return [sys.executable, "-m", "megafixed.cli", "train", "/dev/null",
            *tiny_overrides(shards, run_dir, "model.input=canonical", "train.max_steps=4", "train.save_interval=2",
                            "train.eval_interval=0", "schedule.warmup_steps=1", "train.keep_checkpoints=0", *extra)]


def _train(shards, run_dir, *extra):
    proc = subprocess.run(_cmd(shards, run_dir, *extra), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _losses(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in
            map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    _train(shards, root / "sync")
    _train(shards, root / "async", "train.async_save=true")
    return root


def _same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")


def test_async_save_writes_what_a_sync_save_writes(runs):
    assert _losses(runs / "async") == _losses(runs / "sync")
    for tag in (TAG2, TAG4):
        sync_dir, async_dir = runs / "sync" / "checkpoints" / tag, runs / "async" / "checkpoints" / tag
        names = sorted(p.name for p in sync_dir.glob("*.pt"))
        assert names == sorted(p.name for p in async_dir.glob("*.pt")) and len(names) == 2
        for name in names:  # weights, Adam moments and step, client state: the same tensors
            a = torch.load(sync_dir / name, map_location="cpu", weights_only=False)
            b = torch.load(async_dir / name, map_location="cpu", weights_only=False)
            for key in ("module", "optimizer_state_dict", "step", "consumed_samples"):
                if key in a:
                    _same(a[key], b[key], f"{tag}/{name}:{key}")
    assert (runs / "async" / "checkpoints" / "latest").read_text().strip() == TAG4


def test_manifest_records_every_file_and_what_the_checkpoint_is(runs):
    tag_dir = runs / "sync" / "checkpoints" / TAG4
    man = json.loads((tag_dir / "manifest.json").read_text())
    on_disk = {p.name: p.stat().st_size for p in tag_dir.iterdir() if p.is_file() and p.name != "manifest.json"}
    assert {e["name"]: e["size"] for e in man["files"]} == on_disk
    import hashlib
    for e in man["files"]:
        assert e["sha256"] == hashlib.sha256((tag_dir / e["name"]).read_bytes()).hexdigest(), e["name"]
    assert (man["step"], man["consumed_samples"], man["consumed_tokens"]) == (4, 32, 32 * 32)
    assert man["layout"] == {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 1, "precision": "fp32"}
    assert man["code"]["input"] == "canonical" and man["code"]["bits"] == 8
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert man["git_revision"] == (rev or "unknown")


def test_ckpt_inspect_reports_known_values(runs, capsys):
    from megafixed.cli import main
    from megafixed.model import GPT

    assert main(["ckpt", "inspect", str(runs / "sync"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    from megafixed.config import load_config
    cfg = load_config(None, tiny_overrides("x", "y"))
    with torch.device("meta"):
        expected = sum(p.numel() for p in GPT(cfg.model).parameters())
    assert info["tag"] == TAG4 and info["step"] == 4
    assert (info["consumed_samples"], info["consumed_tokens"]) == (32, 1024)
    assert info["layout"]["tp"] == 1 and info["layout"]["zero_stage"] == 1
    assert info["code"] == {"input": "canonical", "bits": 8, "scale": 1.0}
    assert info["parameters"] == expected
    tag_dir = runs / "sync" / "checkpoints" / TAG4
    assert info["files"]["mp_rank_00_model_states.pt"] == (tag_dir / "mp_rank_00_model_states.pt").stat().st_size
    assert info["manifest"] == {"ok": True, "problem": None}
    assert main(["ckpt", "inspect", str(tag_dir.parent / TAG2)]) == 0  # a tag directory, as text
    text = capsys.readouterr().out
    assert "step        2" in text and "16 samples, 512 tokens" in text and "manifest    verified" in text


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_file_is_named_by_inspect_and_on_resume(runs, tmp_path, capsys, damage):
    from megafixed.cli import main

    run_dir = tmp_path / "run"
    shutil.copytree(runs / "sync", run_dir)
    victim = run_dir / "checkpoints" / TAG4 / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        victim.write_bytes(data[:1000] + bytes([data[1000] ^ 1]) + data[1001:])
    else:
        victim.unlink()
    assert main(["ckpt", "inspect", str(run_dir)]) == 1
    assert f"{victim}" in capsys.readouterr().out
    from megafixed.train import manifest
    from megafixed.train.checkpoint import CheckpointError
    why = {"truncate": "truncated", "flip": "corrupt", "delete": "missing"}[damage]
    with pytest.raises(CheckpointError, match=rf"{victim.name}.*{why}.*latest at an earlier tag"):
        manifest.verify(victim.parent)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_9_mid_save_leaves_the_previous_checkpoint_latest_and_loadable(shards, runs, tmp_path, mode):
    run_dir = tmp_path / "run"
    extra = ("train.async_save=true",) if mode == "async" else ()
    env = {**os.environ, "MEGAFIXED_TEST_SLOW_SAVE": TAG4}  # the step-4 save stalls after its first file
    proc = subprocess.Popen(_cmd(shards, run_dir, *extra), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    tag4 = run_dir / "checkpoints" / TAG4
    deadline = time.time() + 240
    while time.time() < deadline and not any(tag4.glob("*.pt")):
        time.sleep(0.05)
    assert any(tag4.glob("*.pt")), "the step-4 save never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == TAG2
    assert not (tag4 / "manifest.json").exists()
    from megafixed.train import manifest
    assert manifest.verify(ckpt / TAG2)["step"] == 2
    # the same command resumes from step 2 and logs what the uninterrupted run logged
    _train(shards, run_dir, *extra)
    assert _losses(run_dir)[-2:] == _losses(runs / "sync")[-2:]
    assert (ckpt / "latest").read_text().strip() == TAG4 and manifest.verify(ckpt / TAG4)["step"] == 4
