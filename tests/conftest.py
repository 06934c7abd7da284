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
# pytest.ini runs the suite on 2 pytest-xdist workers (`--dist loadgroup --no-loadscope-reorder`): one
# worker kept 2 cores only ~54% busy (measured 2026-12-03: 1300 CPU-s in 1191 s), because most tests wait
# on one subprocess at a time, and a starting Python process is single-threaded.
#  * every test of a file stays on one worker, so a module's shared launches are not repeated per worker
#    (the scheduler below; tests/test_worker_groups.py checks it);
#  * EXCLUSIVE groups run with the other worker idle: the Slurm files start clusters whose dozen ranks are
#    already CPU-bound by design (a worker beside them starved the 3-node cluster on 2026-12-02: "node3 not
#    responding", a job past its 240 s deadline), and they share one cluster name space. (The resilience and
#    rendezvous drills, whose faults are timed against timeouts, share the machine: their bounds leave tens of
#    seconds, and slow ranks are named by CPU time, not wall time);
#  * the exclusive groups go first, then the longest files, so the last to finish is a short one.
# A readers-writer lock over two files (fcntl, shared by the workers of one run) keeps the exclusive groups
# alone: an exclusive group takes the turnstile and then the room, both exclusively, for all its tests; any
# other test passes the turnstile and holds the room shared for its own duration, so a waiting exclusive
# group is not overtaken by the other worker's next test.
SLURM_FILES = ("test_slurm.py", "test_slurm_nodes.py", "test_preprocess_slurm.py")
EXCLUSIVE = ("slurm",)
LONGEST_FIRST = (*EXCLUSIVE, "test_fake_measure.py", "test_soak.py", "test_native_pipeline.py",
                 "test_parallel_train.py", "test_resilience.py", "test_unattended.py", "test_native_checkpoint.py",
                 "test_native_tp.py", "test_parallel.py", "test_native_3d.py",
                 "test_bench_eval.py", "test_native_engine.py", "test_gpu_check.py", "test_ckpt_universal.py",
                 "test_bad_inputs.py", "test_startup_imports.py", "test_rendezvous.py", "test_run_integrity.py",
                 "test_deepspeed_memory.py", "test_resilience_pipeline.py")


def _group_of(file_name: str) -> str:
    return "slurm" if file_name in SLURM_FILES else file_name


def _group(item) -> str:
    return _group_of(item.path.name)


def pytest_collection_modifyitems(config, items):
    rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable: a file keeps its own order


@pytest.hookimpl(optionalhook=True)  # optional: the hook exists only where pytest-xdist is installed
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`, with our groups as the scopes, read from the test's file name.

    Not xdist's own LoadGroupScheduling with `xdist_group` marks: that one finds a test's group in an
    ``@group`` suffix its workers append to ``item._nodeid``, and pytest 9 builds ``nodeid`` from ``_id``, so
    the suffix never arrives and every test became its own scope (found 2026-12-03, pytest 9.2.0 with
    pytest-xdist 3.8.0: the 72 s module fixture of test_fake_measure was built on both workers). A scope
    read from the file name does not depend on either version. Other `--dist` modes stay xdist's."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(Path(nodeid.split("::", 1)[0]).name)

    return FileGroupScheduling(config, log)


class _Room:
    """The readers-writer lock above, for this worker's process."""

    def __init__(self, run_id: str):
        base = Path(tempfile.gettempdir()) / f"megafixed-pytest-{run_id}"
        self.turnstile = open(f"{base}.turnstile", "a+")
        self.room = open(f"{base}.room", "a+")
        self.exclusive_group = None  # the exclusive group this worker holds the room for

    def enter(self, group: str) -> None:
        import fcntl

        if group == self.exclusive_group:
            return
        self.leave()
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        if group in EXCLUSIVE:
            fcntl.flock(self.room, fcntl.LOCK_EX)
            self.exclusive_group = group  # the turnstile stays closed until the group is done
        else:
            fcntl.flock(self.room, fcntl.LOCK_SH)
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def leave(self) -> None:
        import fcntl

        fcntl.flock(self.room, fcntl.LOCK_UN)
        if self.exclusive_group is not None:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
            self.exclusive_group = None


_room: _Room | None = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _room
    workerinput = getattr(item.config, "workerinput", None)
    if workerinput is None or workerinput.get("workercount", 1) < 2:  # one process: nothing runs beside it
        yield
        return
    if _room is None:
        _room = _Room(workerinput["testrunuid"])
    group = _group(item)
    _room.enter(group)
    try:
        yield
    finally:
        # an exclusive group keeps the room from its first test's set-up to its last test's teardown (its
        # module fixtures may leave jobs running between tests); any other test leaves after itself
        if group not in EXCLUSIVE or nextitem is None or _group(nextitem) != group:
            _room.leave()


def pytest_unconfigure(config):
    if _room is not None:  # the worker is done: its lock files close (and any lock it held goes with them)
        _room.turnstile.close()
        _room.room.close()
