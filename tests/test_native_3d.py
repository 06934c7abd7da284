"""The torch engine at 3D on 8 gloo ranks (TP x PP x DP), against one process, through ``megafixed train``.

One 8-rank launch (``native_3d_worker.py``: several trainer runs in one world, imports paid once)
trains a 6-layer GF(2)-code model, clipping on every step:

- ``3d``: TP2 x PP2 x DP2 with FSDP2, sequence parallelism and Interleaved1F1B (2 stages per rank),
  6 steps, a checkpoint and a validation every 2;
- ``hsdp``: TP2 x PP2 with HSDP (``torch_engine.dp_replicate=2``), 4 steps;
- ``dp8``: ``3d``'s step-2 checkpoint resumed at DP8 (FSDP2 over 8 ranks) to step 4, and ``back``:
  that DP8 step-4 checkpoint resumed at TP2 x PP2 x DP2 to the end;
- ``victim``: the ``3d`` command again, every rank SIGKILLed before step 4 (``faults.inject=exit@4``),
  which ends the launch; the same command is then rerun through ``torchrun ... megafixed train``.

Beside it, one process trains the same run from scratch (the reference) and resumes ``3d``'s step-2
checkpoint. Asserted: every layout's losses, gradient norms and validation losses within 1e-5 of
one process; the resumes (weights and Adam's state re-laid out by DCP) within 1e-5 of the
uninterrupted run; the killed run's rerun bit for bit; on every rank the same bits for the guard's
inputs (loss and norm) at every step, and no DTensor "sequential all_reduce" warning; and the
rerun's 8-rank log holds each library warning at most once.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _env import launch_free_env
from _launch import torchrun_cmd
from _metrics import assert_rows_match, read_metrics
from _train_data import reference_overrides

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-5
STEPS, CLIP = 6, 0.05
RUN = ("model.n_layers=6", "train.engine=torch", f"train.max_steps={STEPS}", "checkpoint.interval=2",
       "validation.interval=2", f"schedule.decay_steps={STEPS}", "train.micro_batch=1", f"optimizer.grad_clip={CLIP}",
       "checkpoint.keep=0")
LAYOUT_3D = ("parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
             "parallel.pp_schedule=Interleaved1F1B", "parallel.vpp=2")
LAYOUT_HSDP = ("parallel.tp=2", "parallel.pp=2", "torch_engine.dp_replicate=2", "train.max_steps=4")


def _overrides(shards, run_dir, *extra) -> list[str]:
    return reference_overrides(shards, run_dir, "gf2", *RUN, *extra)


def _env() -> dict:
    return launch_free_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _train(nproc: int, overrides: list[str]) -> subprocess.CompletedProcess:
    args = ["-m", "megafixed.cli", "train", "/dev/null", *overrides]
    cmd = [sys.executable, *args] if nproc == 1 else torchrun_cmd(nproc, args)
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)


def _rewind(src: Path, dst: Path, tag: str) -> Path:
    shutil.copytree(src, dst)
    for d in (dst / "checkpoints").iterdir():
        if d.is_dir() and d.name > tag:
            shutil.rmtree(d)
    (dst / "checkpoints" / "latest").write_text(tag + "\n")
    return dst


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory):
    """The 8-rank launch, the rerun of its killed run, and the one-process runs (see the module doc)."""
    tmp = tmp_path_factory.mktemp("native_3d")
    d = {name: tmp / name for name in ("3d", "hsdp", "dp8", "back", "victim", "one", "one_resumed")}
    spec = {"runs": [
        {"name": "3d", "overrides": _overrides(tiny_shards, d["3d"], *LAYOUT_3D)},
        {"name": "hsdp", "overrides": _overrides(tiny_shards, d["hsdp"], *LAYOUT_HSDP)},
        {"name": "dp8", "overrides": _overrides(tiny_shards, d["dp8"], "train.max_steps=4"),
         "rewind": [str(d["3d"]), "step_00000002"]},
        {"name": "back", "overrides": _overrides(tiny_shards, d["back"], *LAYOUT_3D),
         "rewind": [str(d["dp8"]), "step_00000004"]},
        {"name": "victim", "overrides": _overrides(tiny_shards, d["victim"], *LAYOUT_3D), "inject": "exit@4"},
    ]}
    (tmp / "spec.json").write_text(json.dumps(spec))
    out = tmp / "out.json"
    launch = subprocess.run(torchrun_cmd(8, [str(ROOT / "tests" / "native_3d_worker.py"), str(tmp / "spec.json"),
                                             str(out)]), cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=900)
    assert launch.returncode != 0 and "rank 0 dies (SIGKILL) before step 4" in launch.stderr, \
        launch.stdout[-3000:] + launch.stderr[-6000:]
    rerun = _train(8, _overrides(tiny_shards, d["victim"], *LAYOUT_3D))  # the victim's command, again
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-6000:]
    one = _train(1, _overrides(tiny_shards, d["one"]))
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-4000:]
    resumed = _train(1, _overrides(tiny_shards, _rewind(d["3d"], d["one_resumed"], "step_00000002")))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    return {"dirs": d, "worker": json.loads(out.read_text()), "rerun": rerun, "resumed": resumed}


def _assert_like(got_dir: Path, want_dir: Path, what: str, first: int = 0, rtol: float = RTOL) -> None:
    """Training rows from step ``first + 1`` on, and the validations among them, alike within ``rtol``."""
    got, want = read_metrics(got_dir, "loss"), read_metrics(want_dir, "loss")[:len(read_metrics(got_dir, "loss"))]
    assert got, what
    assert_rows_match(got[first:], want[first:], what, rtol=rtol)
    vals = [(r["step"], r["val_loss"]) for r in read_metrics(got_dir, "val_loss") if r["step"] > first]
    ref = {r["step"]: r["val_loss"] for r in read_metrics(want_dir, "val_loss")}
    assert vals, f"{what}: no validation after step {first}"
    for step, v in vals:
        assert math.isclose(v, ref[step], rel_tol=rtol), f"{what}: validation at step {step} {v} vs {ref[step]}"


@pytest.mark.multiprocess
def test_tp2_pp2_dp2_with_fsdp2_sp_and_interleaved_1f1b_equals_one_process(runs):
    r = runs["worker"]["3d"]
    assert "tp 2 x pp 2 x dp 2" in r["describe"], r["describe"]
    one = read_metrics(runs["dirs"]["one"], "loss")
    assert [row["step"] for row in one] == list(range(1, STEPS + 1))
    assert all(row["grad_norm"] > CLIP for row in one)  # every step was clipped: the norm had to be right
    _assert_like(runs["dirs"]["3d"], runs["dirs"]["one"], "TP2xPP2xDP2 (FSDP2, SP, Interleaved1F1B)")


@pytest.mark.multiprocess
def test_hsdp_with_tp_and_pp_equals_one_process(runs):
    r = runs["worker"]["hsdp"]
    assert "tp 2 x pp 2 x dp 2" in r["describe"] and r["step"] == 4, r
    # FSDP2 was given the 2-D (replicate, shard) mesh on rank 0: two replicas of one shard, HSDP, not FSDP over 2
    assert r["fsdp_meshes"] == ['[["dp_replicate", "dp_shard"], [2, 1]]'], r["fsdp_meshes"]
    assert runs["worker"]["3d"]["fsdp_meshes"] == ['[["dp_shard"], [2]]'], runs["worker"]["3d"]["fsdp_meshes"]
    _assert_like(runs["dirs"]["hsdp"], runs["dirs"]["one"], "TP2xPP2 x HSDP(2x1)")


@pytest.mark.multiprocess
def test_3d_checkpoint_resumes_at_dp8_and_dp8_resumes_at_3d_with_the_optimizer(runs):
    w, d = runs["worker"], runs["dirs"]
    assert w["dp8"]["resumed_from"] == "step_00000002" and w["back"]["resumed_from"] == "step_00000004"
    dp8_line = next(ln for ln in w["dp8"]["lines"] if ln.startswith("resumed from"))
    assert "parallel.tp 2 -> 1" in dp8_line and "parallel.pp 2 -> 1" in dp8_line, dp8_line
    back_line = next(ln for ln in w["back"]["lines"] if ln.startswith("resumed from"))
    assert "parallel.tp 1 -> 2" in back_line and "parallel.pp 1 -> 2" in back_line, back_line
    _assert_like(d["dp8"], d["3d"], "3d -> dp8", first=2)  # steps 3-4 at DP8
    _assert_like(d["back"], d["3d"], "3d -> dp8 -> 3d", first=4)  # steps 5-6 at TP2xPP2xDP2 again
    rows = read_metrics(d["back"], "loss")
    assert rows[-1]["loss"] < rows[0]["loss"]  # trained: a lost Adam state would not stay within 1e-5 above


@pytest.mark.multiprocess
def test_3d_checkpoint_resumes_on_one_process_with_the_optimizer(runs):
    line = next(ln for ln in runs["resumed"].stdout.splitlines() if ln.startswith("resumed from"))
    assert "(step 2, 16 samples consumed)" in line and "parallel.tp 2 -> 1" in line, line
    _assert_like(runs["dirs"]["one_resumed"], runs["dirs"]["3d"], "3d -> one process", first=2)


@pytest.mark.multiprocess
def test_a_3d_run_killed_mid_run_reruns_bit_identically(runs):
    line = next(ln for ln in runs["rerun"].stdout.splitlines() if ln.startswith("resumed from"))
    assert "(step 2, 16 samples consumed)" in line, line
    keys = ("step", "loss", "grad_norm", "consumed_samples", "lr")
    got, want = read_metrics(runs["dirs"]["victim"], "loss"), read_metrics(runs["dirs"]["3d"], "loss")
    assert [r["step"] for r in want] == list(range(1, STEPS + 1))
    assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in want]  # the same bits
    assert [r["val_loss"] for r in read_metrics(runs["dirs"]["victim"], "val_loss")] == \
        [r["val_loss"] for r in read_metrics(runs["dirs"]["3d"], "val_loss")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,first,last", [("3d", 1, STEPS), ("hsdp", 1, 4), ("dp8", 3, 4), ("back", 5, STEPS)])
def test_the_guards_inputs_have_the_same_bits_on_all_8_ranks(runs, name, first, last):
    r = runs["worker"][name]
    assert r["ranks"] == 8
    # every step judged twice, the loss and then the norm, on every rank
    assert [(s, what) for s, what, _ in r["judged"]] == [(s, w) for s in range(first, last + 1)
                                                         for w in ("loss", "grad_norm")], r["judged"]
    assert r["same_bits_on_every_rank"], name
    assert r["sequential_all_reduce_warnings"] == 0, name


WARNING = re.compile(r"(Warning|WARNING|\]:W\d{4} )")


@pytest.mark.multiprocess
def test_an_8_rank_log_holds_each_library_warning_at_most_once(runs):
    log = runs["rerun"].stdout + runs["rerun"].stderr
    assert "sequential all_reduce" not in log
    warnings = [ln for ln in log.splitlines() if WARNING.search(ln)]
    assert len(warnings) == len(set(warnings)), "\n".join(warnings)
    assert not re.search(r"^\[rank[1-7]\]", log, re.M), log[-3000:]  # nothing printed per rank
    # a rank's own facts still reach the log once each: the resume, the steps, the end
    assert sum(ln.startswith("resumed from") for ln in log.splitlines()) == 1
    assert sum(ln.startswith("done:") for ln in log.splitlines()) == 1
