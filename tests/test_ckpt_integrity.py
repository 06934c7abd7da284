"""Checkpoint integrity: manifests, async saves, a kill -9 mid-save, and ``megafixed ckpt inspect``.

All through the real CLI (``python -m megafixed.cli train``), single process, tiny model, 4 steps.
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from _env import launch_free_env
from _metrics import read_metrics
from _train_data import reference_overrides, tiny_overrides

ROOT = Path(__file__).resolve().parent.parent
TAG2, TAG4 = "step_00000002", "step_00000004"


@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards  # the session's, so the shared single-process reference run reads the same files


def _cmd(shards, run_dir, *extra):
    # the shared reference command (conftest.tiny_reference), keeping every checkpoint
    return [sys.executable, "-m", "megafixed.cli", "train", "/dev/null",
            *reference_overrides(shards, run_dir, "canonical", "checkpoint.keep=0", *extra)]


def _train(shards, run_dir, *extra):
    proc = subprocess.run(_cmd(shards, run_dir, *extra), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _losses(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run_dir, "loss")]


@pytest.fixture(scope="module")
def runs(shards, tiny_reference, tmp_path_factory):
    """``sync``: the session's reference run (a copy; with 2 checkpoints in 4 steps, keep_checkpoints'
    default of 2 keeps the same ones as _cmd's 0); ``async``: the same with checkpoint.async_save,
    trained while the reference trains (if it was not trained yet)."""
    root = tmp_path_factory.mktemp("runs")
    with open(root / "async.log", "w+") as log:  # a file, not a pipe: a full pipe would stall the run
        proc = subprocess.Popen(_cmd(shards, root / "async", "checkpoint.async_save=true"), cwd=ROOT,
                                env=launch_free_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            shutil.copytree(tiny_reference("canonical")["canonical"], root / "sync", symlinks=True)
        finally:
            code = proc.wait(timeout=600)
        log.seek(0)
        assert code == 0, log.read()[-6000:]
    return root


def _same(a, b, where=""):
    """``a`` and ``b`` are the same tree: the same keys, lengths and types, equal tensors (dtype too),
    arrays and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(set(a) ^ set(b), key=str)[:5])
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), where
    elif type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):  # DeepSpeed's LossScaler: equal fields
        assert type(a) is type(b), (where, type(a), type(b))
        _same(vars(a), vars(b), f"{where}.__dict__")
    else:  # a step, a sample count, a learning rate, a name: the same type and value
        assert type(a) is type(b) and a == b, (where, a, b)


def test_async_save_writes_what_a_sync_save_writes(runs):
    assert _losses(runs / "async") == _losses(runs / "sync")
    for tag in (TAG2, TAG4):
        sync_dir, async_dir = runs / "sync" / "checkpoints" / tag, runs / "async" / "checkpoints" / tag
        names = sorted(p.name for p in sync_dir.glob("*.pt"))
        assert names == sorted(p.name for p in async_dir.glob("*.pt")) and len(names) == 2
        compared = set()  # every key below is in one of the two files: none is skipped unseen
        for name in names:  # weights, Adam moments and step, client state: the same tensors
            a = torch.load(sync_dir / name, map_location="cpu", weights_only=False)
            b = torch.load(async_dir / name, map_location="cpu", weights_only=False)
            for key in ("module", "optimizer_state_dict", "step", "consumed_samples"):
                assert (key in a) == (key in b), f"{tag}/{name}: {key} in only one of the two"
                if key in a:
                    _same(a[key], b[key], f"{tag}/{name}:{key}")
                    compared.add(key)
        assert compared == {"module", "optimizer_state_dict", "step", "consumed_samples"}, (tag, compared)
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
    assert man["layout"] == {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 1, "precision": "fp32",
                           "engine": "deepspeed"}
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
    from megafixed.run import manifest
    from megafixed.train.checkpoint import CheckpointError
    why = {"truncate": "truncated", "flip": "corrupt", "delete": "missing"}[damage]
    with pytest.raises(CheckpointError, match=rf"{victim.name}.*{why}.*latest at an earlier tag"):
        manifest.verify(victim.parent)


@pytest.fixture(scope="module")
def killed_mid_save(shards, tmp_path_factory):
    """Both modes' kill -9 scenario side by side (each a lone process, so the pair uses two cores
    where one after the other would leave one idle): start the run with its step-4 save stalled after
    its first file, SIGKILL it once that file exists, note what is on disk, then run the same
    command again to resume. {mode: what the test asserts}."""
    from megafixed.run import manifest

    root = tmp_path_factory.mktemp("killed")
    env = {**launch_free_env(), "MEGAFIXED_PAUSE": "checkpoint.file@4"}  # the step-4 save stalls after its first file
    runs = {}
    for mode in ("sync", "async"):
        extra = ("checkpoint.async_save=true",) if mode == "async" else ()
        run_dir = root / mode / "run"
        proc = subprocess.Popen(_cmd(shards, run_dir, *extra), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        runs[mode] = {"run_dir": run_dir, "extra": extra, "proc": proc}
    deadline = time.monotonic() + 300  # only a bound for a hang: each save stalls until it is killed
    waiting = dict(runs)
    while waiting and time.monotonic() < deadline:  # each killed as soon as its own stalled save has begun
        for mode, r in list(waiting.items()):
            if any((r["run_dir"] / "checkpoints" / TAG4).glob("*.pt")):
                r["proc"].send_signal(signal.SIGKILL)
                del waiting[mode]
            elif r["proc"].poll() is not None:  # it ended without stalling: the test says so below
                del waiting[mode]
        time.sleep(0.05)
    for r in runs.values():
        tag4 = r["run_dir"] / "checkpoints" / TAG4
        r["save_started"] = any(tag4.glob("*.pt"))
        r["proc"].send_signal(signal.SIGKILL)  # a run whose save never started is stopped too
        r["proc"].wait(timeout=60)
        ckpt = r["run_dir"] / "checkpoints"
        r["latest"] = (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else None
        r["tag4_manifest"] = (tag4 / "manifest.json").exists()
        try:
            r["tag2_step"] = manifest.verify(ckpt / TAG2)["step"]
        except Exception as exc:  # asserted (and shown) by the test
            r["tag2_step"] = exc
    # the same command resumes from step 2, both modes at once
    for r in runs.values():
        r["log"] = open(r["run_dir"].parent / "resume.log", "w+")  # a file, not a pipe: a full pipe would stall it
        r["resume"] = subprocess.Popen(_cmd(shards, r["run_dir"], *r["extra"]), cwd=ROOT, env=launch_free_env(),
                                       stdout=r["log"], stderr=subprocess.STDOUT)
    for r in runs.values():
        r["resume_code"] = r["resume"].wait(timeout=600)
        r["log"].seek(0)
        r["resume_output"] = r["log"].read()[-6000:]
        r["log"].close()
    return runs


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_9_mid_save_leaves_the_previous_checkpoint_latest_and_loadable(killed_mid_save, runs, mode):
    r = killed_mid_save[mode]
    run_dir = r["run_dir"]
    assert r["save_started"], "the step-4 save never started"
    ckpt = run_dir / "checkpoints"
    assert r["latest"] == TAG2
    assert not r["tag4_manifest"]
    assert r["tag2_step"] == 2, r["tag2_step"]
    # the same command resumed from step 2 and logged what the uninterrupted run logged
    assert r["resume_code"] == 0, r["resume_output"]
    from megafixed.run import manifest
    assert _losses(run_dir)[-2:] == _losses(runs / "sync")[-2:]
    assert (ckpt / "latest").read_text().strip() == TAG4 and manifest.verify(ckpt / TAG4)["step"] == 4
