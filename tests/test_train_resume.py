"""Exact resume: a run killed with SIGKILL between checkpoints and started again logs the same
losses, bit for bit, as an uninterrupted run (CPU, fp32)."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from _env import launch_free_env
from _metrics import logged_step, read_metrics
from _pause import ended, pause_env, wait_paused
from _train_data import tiny_overrides, write_shards

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVE = 60, 20


def cli(run_dir: Path, prefix: str) -> list[str]:
    cfg = run_dir.parent / "empty.yaml"
    cfg.write_text("{}\n")
    # dropout > 0 so that the RNG state is part of what must be restored
    return [sys.executable, "-m", "megafixed.cli", "train", str(cfg),
            *tiny_overrides(prefix, run_dir, f"train.max_steps={STEPS}", f"checkpoint.interval={SAVE}",
                            "model.dropout=0.1", "model.input=gf2", "validation.interval=25")]


def env() -> dict:
    return launch_free_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # fresh single-process runs


def losses(run_dir: Path) -> dict:
    return {r["step"]: (r.get("loss"), r.get("val_loss"), r["consumed_samples"]) for r in read_metrics(run_dir)}


@pytest.mark.multiprocess
def test_kill9_between_saves_then_resume_is_bit_identical(tmp_path):
    prefix = write_shards(tmp_path / "data")
    ref_dir, killed_dir = tmp_path / "ref" / "run", tmp_path / "killed" / "run"
    for d in (ref_dir, killed_dir):
        d.parent.mkdir(parents=True)
    # Uninterrupted reference, started concurrently with the run we are going to kill.
    ref_log = open(tmp_path / "ref.log", "w")  # a file, not a pipe: a full pipe would stall the run
    ref = subprocess.Popen(cli(ref_dir, prefix), cwd=ROOT, env=env(), stdout=ref_log, stderr=subprocess.STDOUT)
    # it stops before step SAVE + 4 (a checkpoint exists and the run is a few steps past it, before the next
    # save) until it is killed there
    paused = tmp_path / "victim.paused"
    victim = subprocess.Popen(cli(killed_dir, prefix), cwd=ROOT, env={**env(), **pause_env(f"train.step@{SAVE + 4}",
                                                                                          paused)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed_dir / "checkpoints" / "latest"
    wait_paused(paused, ended(victim))
    killed_at = logged_step(killed_dir)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert killed_at is not None, "the run finished or stalled before it could be killed between saves"
    assert victim.returncode == -signal.SIGKILL
    saved = int(latest.read_text().strip().split("_")[1])
    assert saved < killed_at < STEPS, (saved, killed_at)

    resumed = subprocess.run(cli(killed_dir, prefix), cwd=ROOT, env=env(), capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and f"step {saved}" in resumed.stdout
    assert ref.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    ref_log.close()

    got, want = losses(killed_dir), losses(ref_dir)
    assert sorted(got) == sorted(want) and len([s for s in want if want[s][0] is not None]) == STEPS
    assert got == want  # exact float equality: same bits, every step, train and validation
