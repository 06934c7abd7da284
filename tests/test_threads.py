"""The CPU thread policy (megafixed/threads.py): one decision, the config or the environment first."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from megafixed import threads
from megafixed.config import ConfigError, load_config


def test_the_config_beats_the_environment_which_beats_the_default(monkeypatch):
    cores = threads.usable_cores()
    assert threads.decide(3, {"OMP_NUM_THREADS": "2"}) == threads.ThreadChoice(3, "asked for")
    assert threads.decide(None, {"OMP_NUM_THREADS": "2"}) == threads.ThreadChoice(2, "OMP_NUM_THREADS")
    assert threads.decide(None, {}).threads == cores
    # torchrun's processes on one node share its cores; never fewer than one thread.
    assert threads.decide(None, {"LOCAL_WORLD_SIZE": "2"}).threads == max(1, cores // 2)
    assert threads.decide(None, {"LOCAL_WORLD_SIZE": str(4 * cores)}).threads == 1
    assert threads.decide(None, {"OMP_NUM_THREADS": "junk"}).threads == cores


def test_apply_sets_torch_and_says_so_once(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_announced", None)
    before = torch.get_num_threads()
    said = []
    try:
        threads.apply_thread_policy(1, log=said.append)
        threads.apply_thread_policy(1, log=said.append)
        assert torch.get_num_threads() == 1 and len(said) == 1
        assert said[0].startswith("cpu threads: 1 intra-op (asked for;") and "train.threads" in said[0]
    finally:
        torch.set_num_threads(before)


def test_train_threads_is_a_checked_config_key():
    assert load_config(None, ["train.threads=2"]).train.threads == 2
    try:
        load_config(None, ["train.threads=-1"])
    except ConfigError as exc:
        assert "train.threads" in str(exc)
    else:
        raise AssertionError("train.threads=-1 was accepted")


def test_the_cli_sets_the_wait_policy_before_torch_loads_openmp():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = ("import sys, os; import megafixed; assert 'torch' not in sys.modules, 'the package imported torch'; "
            "import megafixed.cli; assert 'torch' not in sys.modules; print(os.environ['OMP_WAIT_POLICY'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "PASSIVE"
    mine = subprocess.run([sys.executable, "-c", "import os, megafixed.cli; print(os.environ['OMP_WAIT_POLICY'])"],
                          env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, capture_output=True, text=True, timeout=120)
    assert mine.stdout.strip() == "ACTIVE"  # the user's choice stands
