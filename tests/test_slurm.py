"""`megafixed submit` and the launch checks on a real Slurm (one node on localhost, 2 CPU ranks, gloo).

The cluster (tests/_slurm.py) starts once for this module; where Slurm cannot start the tests skip
with the reason. Checked: a submitted 2-rank job trains; the pre-timeout signal makes it
checkpoint, requeue itself and continue with the losses of an uninterrupted run; a bad
environment under a real ``srun`` fails in seconds with a message.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _metrics import read_metrics
from _pause import pause_env, wait_paused
from _slurm import start_cluster
from _train_data import tiny_overrides, write_shards

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    found = start_cluster(tmp_path_factory.mktemp("slurm"))
    if isinstance(found, str):
        pytest.skip(found)
    # The job runs `python -m megafixed.cli` from the submit directory (ROOT): this checkout's code.
    found.env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    yield found
    found.stop()


@pytest.fixture(scope="module")
def job_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm-data")
    cfg = root / "empty.yaml"
    cfg.write_text("{}\n")
    return str(cfg), write_shards(root / "shards")


def submit(cluster, cfg, prefix, run_dir, *extra, env=None) -> str:
    cmd = [sys.executable, "-m", "megafixed.cli", "submit", cfg, "--cpu", "--gpus-per-node", "2", "--cpus-per-task",
           "1", "--time", "00:10:00", *tiny_overrides(prefix, run_dir, *extra)]
    out = subprocess.run(cmd, cwd=ROOT, env={**cluster.env, **(env or {})}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "loss")}


def job_log(run_dir, job_id) -> str:
    return (Path(run_dir) / "slurm" / f"{job_id}.out").read_text()


STEPS = ("train.max_steps=30", "validation.interval=0", "checkpoint.interval=100")


def test_a_submitted_job_trains_and_after_the_pre_timeout_signal_requeues_and_continues_identically(
        cluster, job_inputs, tmp_path):
    cfg, prefix = job_inputs
    # 1. a 2-rank job, sent its pre-timeout signal (--signal=B:USR1 goes to the batch shell) mid-run: rank 0
    # stops before step 4 until the signal reaches it (rank 1 waits for it there), so the job cannot end first
    run_dir, paused = tmp_path / "stopped", tmp_path / "stopped.paused"
    job = submit(cluster, cfg, prefix, run_dir, *STEPS, env=pause_env("train.step@4:rank=0", paused))

    def gone():
        state = cluster.job_state(job).get("JobState")
        return f"{state}: {job_log(run_dir, job)[-3000:]}" if state not in ("PENDING", "RUNNING") else None
    wait_paused(paused, gone)
    # held (a running job runs on): its requeue then stays pending until released, however late the test looks
    cluster.run("scontrol", "hold", job)
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    info = cluster.wait_for(job, {"PENDING", "COMPLETED", "FAILED"})
    # requeued: pending again, restarted once. Slurm holds a requeued job back until its old credential
    # expires (BeginTime; cred_expire=10 s in the test cluster's slurm.conf); then it starts by itself.
    assert info["JobState"] == "PENDING" and info["Restarts"] == "1", job_log(run_dir, job)
    first_log = job_log(run_dir, job)
    stopped_at = sorted(losses(run_dir))[-1]
    assert f"checkpoints/step_{stopped_at:08d}" in first_log and "requeueing job" in first_log
    assert 3 <= stopped_at < 30
    cluster.run("scontrol", "release", job)

    # 2. the same job uninterrupted, the reference curve: submitted now, it runs while the requeued job
    # waits out its credential (the node has room for one 2-rank job, so they never share it)
    straight = tmp_path / "straight"
    straight_job = submit(cluster, cfg, prefix, straight, *STEPS)
    info = cluster.wait_for(straight_job, {"COMPLETED", "FAILED", "CANCELLED"})
    assert info["JobState"] == "COMPLETED", job_log(straight, straight_job)
    reference = losses(straight)
    assert sorted(reference) == list(range(1, 31)) and reference[30] < reference[1] - 0.5  # it learned
    recorded = [json.loads(line) for line in (straight / "slurm" / "jobs.jsonl").read_text().splitlines()]
    assert [r["job_id"] for r in recorded] == [straight_job] and recorded[0]["world"] == 2
    assert Path(recorded[0]["script"]).read_text().startswith("#!/bin/bash")

    # 3. the requeued job started again by itself and continued identically
    info = cluster.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED"})
    log = job_log(run_dir, job)
    assert info["JobState"] == "COMPLETED", log
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped_at:08d}'}" in log
    assert "start 1," in log  # the second start of the same job id (SLURM_RESTART_COUNT=1)
    assert losses(run_dir) == reference  # bit-identical, CPU fp32


def _srun_train(cluster, job_inputs, tmp_path, *srun_args, env=None):
    cfg, prefix = job_inputs
    cmd = ["srun", "-n2", "--cpus-per-task=1", *srun_args, sys.executable, "-m", "megafixed.cli", "train", cfg,
           *tiny_overrides(prefix, tmp_path / "run", "train.max_steps=2", "validation.interval=0")]
    t0 = time.time()
    out = subprocess.run(cmd, cwd=ROOT, env={**cluster.env, **(env or {})}, capture_output=True, text=True,
                         timeout=180)
    return out, time.time() - t0


def test_plain_srun_tasks_find_their_rank_and_master_themselves(cluster, job_inputs, tmp_path):
    # one task per rank, no torchrun, no MASTER_ADDR: SLURM_PROCID/NTASKS/LOCALID and a derived head + port
    out, _ = _srun_train(cluster, job_inputs, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dp 2" in out.stdout and sorted(losses(tmp_path / "run")) == [1, 2]


def test_a_world_that_disagrees_with_the_job_fails_in_seconds_under_srun(cluster, job_inputs, tmp_path):
    # the job script says nodes x GPUs = 4 ranks; srun started 2: refused before any rendezvous (whose wait is
    # 600 s here: the bound below, generous for a loaded machine, is far from it)
    out, seconds = _srun_train(cluster, job_inputs, tmp_path, env={"MEGAFIXED_EXPECTED_WORLD": "4",
                                                                   "MEGAFIXED_RDZV_TIMEOUT": "600"})
    assert out.returncode != 0
    assert "sees a world of 2 ranks (from srun) but the job asked for 4" in out.stderr
    assert seconds < 300 and not (tmp_path / "run").exists()

