"""Multi-node training on a real multi-node Slurm: 2 nodes (network namespaces, tests/_slurm_nodes.py),
2 CPU ranks each, every job submitted by ``megafixed submit`` (its real sbatch script).

Checked: DP, TP=2 across nodes and PP=2 across nodes train with the losses of one process; the
rendezvous uses the head node's network address although its name maps to 127.0.1.1; a pre-timeout
stop checkpoints on every rank at one step, requeues and finishes with the uninterrupted losses; a
node that dies mid-step (its ranks killed, or its link cut) is named by the survivors within the
run's collective timeout, and a resubmitted job resumes from the last checkpoint with identical
losses; a node that never starts its task, or runs other code, is refused within the rendezvous
timeout, naming it.

Run as root (network namespaces), serialised with the other Slurm tests:
``flock /tmp/megafixed-slurm.lock python -m pytest -m multinode``.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _slurm_nodes import start_cluster
from _train_data import tiny_overrides, write_shards

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.multinode, pytest.mark.multiprocess]

STEPS = 8
RDZV_TIMEOUT = 40  # seconds; every rank of a job here starts within a few seconds of the others
COLLECTIVE_TIMEOUT = 20  # parallel.collective_timeout_s of these runs: the bound on detecting a dead node
COMMON = (f"train.max_steps={STEPS}", "train.eval_interval=0", "train.save_interval=2", "train.micro_batch=2",
          "schedule.warmup_steps=1", f"parallel.collective_timeout_s={COLLECTIVE_TIMEOUT}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    found = start_cluster(tmp_path_factory.mktemp("slurm-nodes"))
    if isinstance(found, str):
        pytest.skip(found)
    # The jobs run `python -m megafixed.cli` from the submit directory (ROOT): this checkout's code.
    found.env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MEGAFIXED_RDZV_TIMEOUT=str(RDZV_TIMEOUT))
    yield found
    left = found.stop()
    assert not left, f"network namespaces left behind: {left}"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes-data")
    cfg = root / "empty.yaml"
    cfg.write_text("{}\n")
    return str(cfg), write_shards(root / "shards")


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    """One process, same data and global batch: the losses every layout must reproduce."""
    cfg, prefix = inputs
    run_dir = tmp_path_factory.mktemp("nodes-ref") / "run"
    out = subprocess.run([sys.executable, "-m", "megafixed.cli", "train", cfg,
                          *tiny_overrides(prefix, run_dir, *COMMON)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=_one_process_env())
    assert out.returncode == 0, out.stderr[-3000:]
    return losses(run_dir)


def _one_process_env() -> dict:
    from _env import launch_free_env

    return {k: v for k, v in launch_free_env(OMP_NUM_THREADS="1").items() if not k.startswith("SLURM_")}


def submit(cluster, inputs, run_dir, *extra, nodes=2, per_node=2, env=None) -> str:
    cfg, prefix = inputs
    cmd = cluster.in_ctl([sys.executable, "-m", "megafixed.cli", "submit", cfg, "--nodes", str(nodes),
                          "--gpus-per-node", str(per_node), "--cpu", "--cpus-per-task", "1", "--time", "00:10:00",
                          *tiny_overrides(prefix, run_dir, *COMMON, *extra)])
    out = subprocess.run(cmd, cwd=ROOT, env={**cluster.env, **(env or {})}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def losses(run_dir) -> dict:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return {}
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def job_log(run_dir, job_id) -> str:
    path = Path(run_dir) / "slurm" / f"{job_id}.out"
    return path.read_text() if path.exists() else ""


def finished(cluster, job, run_dir, state="COMPLETED", timeout=240) -> dict:
    info = cluster.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=timeout)
    assert info["JobState"] == state, job_log(run_dir, job)[-6000:]
    return info


def assert_same_losses(got: dict, ref: dict, what: str) -> None:
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1)), (what, got)
    for step in ref:
        assert math.isclose(got[step], ref[step], rel_tol=1e-5), f"{what}: step {step}: {got[step]} vs {ref[step]}"


def wait_for_step(run_dir, step: int, job, cluster, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if max(losses(run_dir), default=0) >= step:
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached in {timeout}s: {cluster.job_state(job)}\n{job_log(run_dir, job)}")


# --- 1 + 2: layouts across nodes, and the rendezvous address ---

def test_dp_across_two_nodes_matches_one_process_and_meets_at_the_head_nodes_address(cluster, inputs, reference,
                                                                                     tmp_path):
    run_dir = tmp_path / "dp"
    job = submit(cluster, inputs, run_dir)
    finished(cluster, job, run_dir)
    log = job_log(run_dir, job)
    assert_same_losses(losses(run_dir), reference, "dp=4 on 2 nodes")
    assert "dp 4" in log
    # node1's own name maps to 127.0.1.1 (Debian's /etc/hosts); megafixed.launch.head fell back to the
    # address of the route towards node2, and every rank met there
    assert "127.0.1.1 node1" in (cluster.root / "hosts-node1").read_text()
    master = re.search(r"master (\S+):(\d+) \((\S+)\)", log)
    assert master and master.groups()[::2] == (cluster.addr("node1"), "node1"), log[-3000:]
    for rank, node in ((0, "node1"), (2, "node2")):
        assert f"rank {rank} of 4 on {node}: rendezvous at {cluster.addr('node1')}:{master.group(2)}" in log
    assert "127.0.0.1:" not in log and "127.0.1.1:" not in log
    # gloo would have bound to 127.0.1.1 too (it uses the hostname's address): pinned to the node's interface
    assert "node2 resolves to loopback; gloo uses eth0 (GLOO_SOCKET_IFNAME)" in log
