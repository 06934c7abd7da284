"""Shared test set-up: DeepSpeed on CPU, a cached JIT-extension dir, a torchrun helper, and the tiny
reference runs several files compare against (trained once per session)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# DeepSpeed picks its accelerator at import; CPU here (CI has no GPU). It JIT-builds nothing here
# (megafixed/engine/deepspeed/ops.py), so TORCH_EXTENSIONS_DIR is left to the product's default.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tokenizers and shards that tests prepare go to a throw-away cache, not the user's ~/.cache.
os.environ.setdefault("MEGAFIXED_CACHE_DIR", tempfile.mkdtemp(prefix="megafixed-test-cache-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_torchrun(nproc: int, args: list[str], cwd: str | os.PathLike | None = None,
                 timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Launch ``python -m torch.distributed.run --nproc-per-node N <args>`` on loopback (gloo); from 6
    ranks on under the machine's one big-launch lock (``_launch.big_lock``)."""
    from _launch import torchrun_cmd

    cmd = torchrun_cmd(nproc, args)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd or ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode})\nSTDOUT:\n{proc.stdout[-4000:]}\n"
                             f"STDERR:\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session")  # a plain function: module fixtures that share a launch use it too
def torchrun():
    return run_torchrun


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory):
    """The trainer tests' synthetic shards (tests/_train_data.py), written once per session."""
    from _train_data import write_shards

    return write_shards(tmp_path_factory.mktemp("tiny_shards"))


@pytest.fixture(scope="session")
def tiny_reference(tiny_shards, tmp_path_factory):
    """``tiny_reference(*kinds) -> {kind: run_dir}``: the single-process ``megafixed train`` of
    _train_data.reference_overrides for each model.input kind, through the real CLI in its own
    process. Each kind is trained once per session (kinds not yet trained run concurrently) and
    shared by every file that compares against it; callers must treat the run dirs as read-only
    (copy one to resume or damage it)."""
    from _env import launch_free_env
    from _train_data import reference_overrides

    runs: dict[str, Path] = {}

    def get(*kinds: str) -> dict[str, Path]:
        started = {}
        for kind in dict.fromkeys(kinds):
            if kind in runs:
                continue
            run_dir = tmp_path_factory.mktemp(f"tiny_ref_{kind}") / "run"
            log = open(run_dir.parent / "train.log", "w+")  # a file, not a pipe: a full pipe would stall it
            cmd = [sys.executable, "-m", "megafixed.cli", "train", "/dev/null",
                   *reference_overrides(tiny_shards, run_dir, kind)]
            started[kind] = (run_dir, log, subprocess.Popen(cmd, cwd=ROOT, env=launch_free_env(), stdout=log,
                                                            stderr=subprocess.STDOUT))
        failed = []
        for kind, (run_dir, log, proc) in started.items():  # wait for all before judging any
            try:
                code = proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            log.seek(0)
            if code == 0:
                runs[kind] = run_dir
            else:
                failed.append(f"reference run ({kind}) failed ({code}):\n{log.read()[-6000:]}")
            log.close()
        assert not failed, "\n".join(failed)
        return {kind: runs[kind] for kind in kinds}

    return get


# ----------------------------------------------------------------------------- two test workers
# pytest.ini runs the suite on 2 pytest-xdist workers (`--dist loadfile --no-loadscope-reorder`): one worker
# kept 2 cores only ~54% busy, because most tests wait on one subprocess at a time, and a starting Python
# process is single-threaded.
#  * every test of a file stays on one worker (`loadfile`), so a module's shared launches are not repeated
#    per worker (tests/test_worker_groups.py checks it);
#  * the longest files go first (xdist hands out files in collection order under `--no-loadscope-reorder`),
#    so the last to finish is a short one;
#  * the Slurm files (`-m slurm`) are left out of this run and run in their own, in one process: their
#    clusters' dozen ranks are CPU-bound by design, and they share one cluster name space (README, `.ci/run`).
LONGEST_FIRST = ("test_fake_measure.py", "test_soak.py", "test_trust_checkpoints.py", "test_native_pipeline.py",
                 "test_parallel_train.py", "test_unattended.py", "test_native_checkpoint.py",
                 "test_native_tp.py", "test_parallel.py", "test_native_3d.py", "test_native_cp.py",
                 "test_deepspeed_cp.py", "test_resilience.py", "test_native_cp_ring.py", "test_cp_ring.py",
                 "test_native_engine.py", "test_gpu_check.py", "test_ckpt_universal.py", "test_bench_eval.py",
                 "test_bad_inputs.py", "test_startup_imports.py", "test_rendezvous.py", "test_run_integrity.py",
                 "test_deepspeed_memory.py", "test_resilience_pipeline.py", "test_float8.py", "test_eval_in_loop.py",
                 "test_callbacks.py", "test_profile.py", "test_kernel_compile.py", "test_eval_in_loop_train.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its own order
