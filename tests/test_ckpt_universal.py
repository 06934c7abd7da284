"""Resume on another layout with the optimizer state: ``megafixed train`` on layout A to step 2, then
the same command on layout B to step 4. The resumed steps 3-4 log the losses and gradient norms of
the run that stayed on one layout (the single-process reference, which a same-layout resume repeats
bit for bit: tests/test_parallel_train.py), within 1e-5 relative -- so weights, Adam's moments and
step, the schedule and the data position all crossed the change (fp32, gloo, ZeRO-1)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _env import launch_free_env
from _metrics import assert_rows_match, read_metrics
from _train_data import reference_overrides

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-5


@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards  # the session's, so the shared single-process reference run reads the same files


def _args(shards, run_dir, steps, *extra):
    # the reference command (zero.stage=1 is the default, named because the universal path needs 1/2)
    return ["-m", "megafixed.cli", "train", "/dev/null",
            *reference_overrides(shards, run_dir, "canonical", f"train.max_steps={steps}", "zero.stage=1", *extra)]


def _train(torchrun, nproc, args):
    return torchrun(nproc, args).stdout


@pytest.fixture(scope="module")
def reference(tiny_reference):
    """Single process, 4 steps, checkpoints at 2 and 4: the losses every layout must reproduce
    (conftest: trained once per session, ``_args(shards, run_dir, 4)`` without its explicit default)."""
    return tiny_reference("canonical")["canonical"]


def _assert_resumed_like_reference(run_dir, ref_dir, what):
    got, ref = read_metrics(run_dir, "loss"), read_metrics(ref_dir, "loss")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4], what
    assert_rows_match(got[2:], ref[2:], f"{what}: data position", keys=("consumed_samples",), rtol=0)
    assert_rows_match(got[2:], ref[2:], what, rtol=RTOL)


AFTER_TWO = {"dp2->dp1": ("train.micro_batch=2",), "tp2->tp1": ("parallel.tp=2",), "pp2->pp1": ("parallel.pp=2",)}


@pytest.fixture(scope="module")
def resumed_after_two(shards, torchrun, tmp_path_factory):
    """Each layout A of AFTER_TWO trained to step 2 on two processes (one launch after another), and
    each run resumed to step 4 on one process as soon as its layout A is done, alongside the next
    launches (a lone process keeps one core busy, so sequential lone runs left the other idle).
    {case: (run_dir, its output) or why it failed}."""
    root = tmp_path_factory.mktemp("after_two")
    done, started = {}, {}
    for name, layout_a in AFTER_TWO.items():
        try:
            _train(torchrun, 2, _args(shards, root / name, 2, *layout_a))
        except AssertionError as failed:  # judged by that case's test alone
            done[name] = f"layout A failed: {failed}"
            continue
        log = open(root / f"{name}.log", "w+")  # a file, not a pipe: a full pipe would stall the run
        started[name] = (log, subprocess.Popen([sys.executable, *_args(shards, root / name, 4)], cwd=ROOT,
                                               env=launch_free_env(), stdout=log, stderr=subprocess.STDOUT))
    for name, (log, proc) in started.items():  # wait for all before judging any
        try:
            code = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        log.seek(0)
        out = log.read()
        log.close()
        done[name] = (root / name, out) if code == 0 else f"the resume failed ({code}):\n{out[-6000:]}"
    return done


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(AFTER_TWO))
def test_resume_on_one_process_after_two(resumed_after_two, reference, name):
    result = resumed_after_two[name]
    assert not isinstance(result, str), result
    run_dir, out = result
    resumed = next(line for line in out.splitlines() if line.startswith("resumed from"))
    assert "layout: " in resumed, resumed
    assert (run_dir / "checkpoints" / "step_00000002" / "universal" / "zero" / "optimizer_state.pt").is_file()
    _assert_resumed_like_reference(run_dir, reference, name)


@pytest.mark.multiprocess
def test_resume_on_two_processes_after_one(shards, reference, torchrun, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    (run_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    out = _train(torchrun, 2, _args(shards, run_dir, 4, "train.micro_batch=2"))
    assert "layout: the data-parallel size (world size / (tp*pp)) 1 -> 2" in out
    _assert_resumed_like_reference(run_dir, reference, "dp1->dp2")
