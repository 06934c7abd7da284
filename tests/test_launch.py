"""Rank/world detection, its consistency checks, the head address and the job script (no Slurm needed)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megafixed.launch import head
from megafixed.launch.sbatch import JobSpec, render
from megafixed.launch.world import LaunchError, World, check_agreement, check_world, detect_world

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x",
            "GROUP_WORLD_SIZE": "2"}
SRUN = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_NODES": "2"}


def test_each_launcher_is_read_and_the_batch_shell_is_one_process():
    assert detect_world(TORCHRUN) == World(4, 3, 1, "torchrun", 2, 2)
    assert detect_world(SRUN) == World(8, 5, 1, "srun", 2)
    assert detect_world({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}).source == "launcher"  # deepspeed
    # `sbatch -n 8` batch shell: SLURM_NTASKS=8 and SLURM_PROCID=0 but no step: one process, not rank 0 of 8
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}
    assert detect_world(batch) == World(1, 0, 0, "single")
    assert detect_world({}) == World(1, 0, 0, "single")


@pytest.mark.parametrize("env, message", [
    ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK is not"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "rank 2 of world size 2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
])
def test_a_half_set_environment_is_refused(env, message):
    with pytest.raises(LaunchError, match=message):
        detect_world(env)


def test_an_inconsistent_world_is_refused_before_any_rendezvous():
    with pytest.raises(LaunchError, match="sees a world of 8 ranks .* asked for 16"):
        check_world(detect_world(SRUN), SRUN | {"MEGAFIXED_EXPECTED_WORLD": "16"})
    # two torchrun agents under one srun step, each --standalone: two worlds of 2 instead of one of 4
    split = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "a",
             "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2"}
    with pytest.raises(LaunchError, match="agents did not form one world"):
        check_world(detect_world(split), split)
    exported = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8"}
    with pytest.raises(LaunchError, match="WORLD_SIZE=4 disagrees with the srun step's SLURM_NTASKS=8"):
        check_world(detect_world(exported), exported)


@pytest.mark.parametrize("addr", ["127.0.0.1", "localhost", "127.0.1.1"])
def test_a_loopback_master_on_several_nodes_is_refused(addr):
    env = SRUN | {"MASTER_ADDR": addr}
    with pytest.raises(LaunchError, match=f"MASTER_ADDR={addr} is a loopback address .* spans 2 nodes"):
        check_world(detect_world(env), env)
    check_world(detect_world(env | {"SLURM_STEP_NUM_NODES": "1"}), env | {"SLURM_STEP_NUM_NODES": "1"})  # one node
    check_world(detect_world(env | {"MASTER_ADDR": "192.0.2.10"}), env | {"MASTER_ADDR": "192.0.2.10"})


def test_the_head_address_is_never_loopback_on_several_nodes(monkeypatch):
    assert head.reachable_address("localhost", 1) == "127.0.0.1"  # one node: loopback is fine
    with pytest.raises(LaunchError, match="resolves only to loopback .* spans 2 nodes"):
        head.reachable_address("localhost", 2, "localhost")
    # Debian's /etc/hosts: the head's own name -> 127.0.1.1; the route towards a peer names its real address
    fake = {"head": ["127.0.1.1"], "peer": ["10.1.2.3"]}
    monkeypatch.setattr(head, "addresses", lambda host: fake[host])
    monkeypatch.setattr(head, "source_address", lambda dest: "10.1.2.1" if dest == "10.1.2.3" else None)
    assert head.reachable_address("head", 2, "peer") == "10.1.2.1"
    fake["head"] = ["127.0.1.1", "10.1.2.1"]
    assert head.reachable_address("head", 2) == "10.1.2.1"


@pytest.mark.parametrize("others, message", [
    ({"master": "10.0.0.2:20007"}, r"disagree on the master \(ranks 0,2-3: 10.0.0.1:20007; ranks 1: 10.0.0.2"),
    ({"job": "8"}, r"disagree on the Slurm job .* two jobs met"),
    ({"host": "n1"}, r"spans 1 of the step's 2 nodes .* separate worlds"),
])
def test_ranks_that_met_but_disagree_are_refused(monkeypatch, others, message):
    import torch.distributed as dist

    base = {"host": "n1", "master": "10.0.0.1:20007", "job": "7", "nnodes": 2}
    infos = [base, base | {"host": "n2"} | others, base | {"host": "n2"}, base]
    if others.get("host"):
        infos = [base, base | others, base, base]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, _mine: out.__setitem__(slice(None), infos))
    with pytest.raises(LaunchError, match=message):
        check_agreement(World(4, 0, 0, "srun", 2), {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "20007"})


def test_the_job_script_is_complete_and_valid_bash(tmp_path):
    spec = JobSpec(config="/c/cfg.yaml", overrides=["train.max_steps=5", "data.prefixes=[/d/x y]"],
                   run_dir=str(tmp_path / "run"), nodes=4, gpus_per_node=8, partition="gpu", account="acc",
                   time="1-00:00:00", signal_before=600, python="/venv/bin/python", workdir="/w")
    text = render(spec, submitted="T")
    assert "{{" not in text and subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --signal=B:USR1@600", "#SBATCH --requeue", "#SBATCH --partition=gpu",
                 "#SBATCH --account=acc", "#SBATCH --time=1-00:00:00", f"#SBATCH --output={tmp_path}/run/slurm/%j.out",
                 "scontrol show hostnames \"$SLURM_JOB_NODELIST\"", "scontrol requeue \"$SLURM_JOB_ID\"",
                 "srun --kill-on-bad-exit=1 --ntasks=\"$MEGAFIXED_EXPECTED_WORLD\" --ntasks-per-node=8 "
                 "/venv/bin/python -m megafixed.cli train /c/cfg.yaml train.max_steps=5 "
                 "'data.prefixes=[/d/x y]' &"):
        assert line in text, line
    assert "--qos" not in text and "ssh " not in text.replace("No ssh", "")
    assert "REQUEUE=${MEGAFIXED_REQUEUE:-0}" in render(JobSpec(**{**spec.__dict__, "requeue": False, "cpu": True}))
    with pytest.raises(LaunchError, match="not a Slurm time limit"):
        render(JobSpec(**{**spec.__dict__, "time": "2h"}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(tmp_path, env) -> tuple[subprocess.CompletedProcess, float]:
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE",
                                                                        "LOCAL_", "TORCHELASTIC", "GROUP_"))}
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "megafixed.cli", "train", str(cfg), "data.mock=true",
                          "train.global_batch=16",
                          f"train.run_dir={tmp_path / 'run'}"], cwd=ROOT, env=clean | env, capture_output=True,
                         text=True, timeout=300)
    return out, time.time() - t0


@pytest.mark.multiprocess
def test_a_bad_environment_fails_fast_from_the_cli(tmp_path):
    # a loopback master on a two-node srun step: refused before the rendezvous
    out, _ = _train(tmp_path, SRUN | {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "MASTER_ADDR": "127.0.0.1",
                                      "MASTER_PORT": str(_free_port())})
    assert out.returncode == 2 and "error: MASTER_ADDR=127.0.0.1 is a loopback address" in out.stderr, out.stderr
    # a rank whose peers never come: gives up after MEGAFIXED_RDZV_TIMEOUT, not torch's 30 minutes
    out, seconds = _train(tmp_path, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                     "MASTER_PORT": str(_free_port()), "MEGAFIXED_RDZV_TIMEOUT": "3"})
    assert out.returncode == 2 and "rendezvous timed out after 3s at MASTER_ADDR=127.0.0.1:" in out.stderr, out.stderr
    assert "1 of 2 ranks never arrived: rank 1; arrived: ranks 0 on" in out.stderr and seconds < 120
    assert not (tmp_path / "run").exists()
