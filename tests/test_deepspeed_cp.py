"""Ulysses context parallelism on the DeepSpeed engine, against one process, through ``megafixed train``.

Two one-process references train first (4 steps, a validation and a checkpoint every 2): the learned
table with GQA (4 query heads, 2 key/value heads) and a fixed code (gf2) with the fused first layer under
ZeRO-2. Then ONE 4-rank launch (``deepspeed_cp_worker.py``: several trainer runs in one world, imports
paid once) trains:

- ``cp4``: the learned table at CP4 (2 key/value heads over 4 ranks: repeated to the query heads first),
  without ZeRO (the step computes the gradient norm itself) and with activation checkpointing (the
  all-to-alls run again in the recomputation);
- ``cp2_tp2``: the learned table at CP2 x TP2 with sequence parallelism (1 key/value head per TP rank),
  under ZeRO-1 (the default);
- ``cp2_zero2``: the fixed code (fused first layer) at CP2 x DP2 under ZeRO-2 (partitioned over data x
  context ranks);
- ``cp1_from_cp2``: ``cp2_zero2``'s step-2 checkpoint resumed at CP1 (DP4), and ``cp2_from_one``: the
  one-process step-2 checkpoint resumed at CP2 x DP2, both through DeepSpeed's universal checkpoint;
- ``victim``: the ``cp2_zero2`` command again, every rank SIGKILLed before step 4 (``faults.inject=exit@4``),
  which ends the launch; the same command is then rerun through ``torchrun ... megafixed train``.

Asserted: losses, gradient norms and validation losses within 1e-5 of one process; the resumes (weights
and Adam's state) within 1e-5 of the uninterrupted run; the killed run's rerun bit for bit. Beside them,
in-process: the plan's refusals of CP x PP and CP x ZeRO-3 on this engine.
"""
from __future__ import annotations

import json
import math
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
RUN = ("validation.interval=2", "validation.iters=1")
LEARNED = ("model.n_kv_heads=2",)
CODE = ("zero.stage=2", "model.fused_first_layer=true")


def _learned(shards, run_dir, *extra) -> list[str]:
    return reference_overrides(shards, run_dir, "learned", *RUN, *LEARNED, *extra)


def _code(shards, run_dir, *extra) -> list[str]:
    return reference_overrides(shards, run_dir, "gf2", *RUN, *CODE, *extra)


def _env() -> dict:
    return launch_free_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _train_cmd(nproc: int, overrides: list[str]) -> list[str]:
    args = ["-m", "megafixed.cli", "train", "/dev/null", *overrides]
    return [sys.executable, *args] if nproc == 1 else torchrun_cmd(nproc, args)


def _rewind(src: Path, dst: Path, tag: str) -> Path:
    shutil.copytree(src, dst)
    for d in (dst / "checkpoints").iterdir():
        if d.is_dir() and d.name > tag:
            shutil.rmtree(d)
    (dst / "checkpoints" / "latest").write_text(tag + "\n")
    return dst


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory):
    """The one-process references, the 4-rank launch and the rerun of its killed run (module doc)."""
    tmp = tmp_path_factory.mktemp("deepspeed_cp")
    d = {name: tmp / name for name in ("one_learned", "one_code", "cp4", "cp2_tp2", "cp2_zero2", "cp1_from_cp2",
                                       "cp2_from_one", "victim")}
    refs = {name: subprocess.Popen(_train_cmd(1, make(tiny_shards, d[name])), cwd=ROOT, env=_env(),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for name, make in (("one_learned", _learned), ("one_code", _code))}
    for name, proc in refs.items():  # the resume at CP2 below starts from one_code's checkpoint
        out = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, f"{name}:\n{out[-4000:]}"
    cp2_zero2 = ("parallel.cp=2", "train.micro_batch=2")  # 4 ranks: CP2 x DP2
    spec = {"runs": [
        {"name": "cp4", "overrides": _learned(tiny_shards, d["cp4"], "parallel.cp=4", "zero.stage=0",
                                              "train.activation_checkpointing=true")},
        {"name": "cp2_tp2", "overrides": _learned(tiny_shards, d["cp2_tp2"], "parallel.cp=2", "parallel.tp=2",
                                                  "parallel.sequence_parallel=true")},
        {"name": "cp2_zero2", "overrides": _code(tiny_shards, d["cp2_zero2"], *cp2_zero2)},
        {"name": "cp1_from_cp2", "overrides": _code(tiny_shards, d["cp1_from_cp2"], "train.micro_batch=2"),
         "rewind": [str(d["cp2_zero2"]), "step_00000002"]},
        {"name": "cp2_from_one", "overrides": _code(tiny_shards, d["cp2_from_one"], *cp2_zero2),
         "rewind": [str(d["one_code"]), "step_00000002"]},
        {"name": "victim", "overrides": _code(tiny_shards, d["victim"], *cp2_zero2), "inject": "exit@4"},
    ]}
    (tmp / "spec.json").write_text(json.dumps(spec))
    out = tmp / "out.json"
    launch = subprocess.run(torchrun_cmd(4, [str(ROOT / "tests" / "deepspeed_cp_worker.py"), str(tmp / "spec.json"),
                                             str(out)]), cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=900)
    assert launch.returncode != 0 and "rank 0 dies (SIGKILL) before step 4" in launch.stderr, \
        launch.stdout[-3000:] + launch.stderr[-6000:]
    rerun = subprocess.run(_train_cmd(4, _code(tiny_shards, d["victim"], *cp2_zero2)), cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-6000:]
    return {"dirs": d, "worker": json.loads(out.read_text()), "rerun": rerun}


def _assert_like(got_dir: Path, want_dir: Path, what: str, first: int = 0, rtol: float = RTOL) -> None:
    """Training rows from step ``first + 1`` on, and the validations among them, alike within ``rtol``."""
    got, want = read_metrics(got_dir, "loss"), read_metrics(want_dir, "loss")
    assert [r["step"] for r in want] == [1, 2, 3, 4], what
    assert_rows_match(got[first:], want[first:], what, rtol=rtol)
    vals = [(r["step"], r["val_loss"]) for r in read_metrics(got_dir, "val_loss") if r["step"] > first]
    ref = {r["step"]: r["val_loss"] for r in read_metrics(want_dir, "val_loss")}
    assert [s for s, _ in vals] == [s for s in (2, 4) if s > first], f"{what}: validations {vals}"
    for step, v in vals:
        assert math.isclose(v, ref[step], rel_tol=rtol), f"{what}: validation at step {step} {v} vs {ref[step]}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,ref,words", [
    ("cp4", "one_learned", "4 ranks = tp 1 x cp 4 x pp 1 x dp 1"),
    ("cp2_tp2", "one_learned", "4 ranks = tp 2 x cp 2 x pp 1 x dp 1"),
    ("cp2_zero2", "one_code", "4 ranks = tp 1 x cp 2 x pp 1 x dp 2"),
])
def test_context_parallel_layouts_equal_one_process(runs, name, ref, words):
    r = runs["worker"][name]
    assert r["describe"].startswith(words) and r["step"] == 4, r
    _assert_like(runs["dirs"][name], runs["dirs"][ref], name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,ref,change", [
    ("cp1_from_cp2", "cp2_zero2", "parallel.cp 2 -> 1"),
    ("cp2_from_one", "one_code", "parallel.cp 1 -> 2"),
])
def test_a_checkpoint_resumes_across_cp_with_the_optimizer(runs, name, ref, change):
    w, d = runs["worker"][name], runs["dirs"]
    assert w["resumed_from"] == "step_00000002", w
    line = next(ln for ln in w["lines"] if ln.startswith("resumed from"))
    assert change in line, line
    assert (d[name] / "checkpoints" / "step_00000002" / "universal" / "zero" / "optimizer_state.pt").is_file()
    _assert_like(d[name], d[ref], f"{ref} -> {name}", first=2)
    rows = read_metrics(d[name], "loss")
    assert rows[-1]["loss"] < read_metrics(d[ref], "loss")[0]["loss"]  # trained: Adam's state went along


@pytest.mark.multiprocess
def test_a_cp2_run_killed_mid_run_reruns_bit_identically(runs):
    line = next(ln for ln in runs["rerun"].stdout.splitlines() if ln.startswith("resumed from"))
    assert "(step 2, 16 samples consumed)" in line, line
    keys = ("step", "loss", "grad_norm", "consumed_samples", "lr")
    got, want = read_metrics(runs["dirs"]["victim"], "loss"), read_metrics(runs["dirs"]["cp2_zero2"], "loss")
    assert [r["step"] for r in want] == [1, 2, 3, 4]
    assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in want]  # the same bits
    assert [r["val_loss"] for r in read_metrics(runs["dirs"]["victim"], "val_loss")] == \
        [r["val_loss"] for r in read_metrics(runs["dirs"]["cp2_zero2"], "val_loss")]


@pytest.mark.parametrize("extra,words", [
    (("parallel.pp=2",), ("parallel.cp=2", "parallel.pp=2", "train.engine=torch")),
    (("zero.stage=3",), ("parallel.cp=2", "zero.stage=3", "zero.stage 1 or 2", "train.engine=torch")),
])
def test_what_this_engine_cannot_do_with_context_parallelism_is_refused_in_one_line(extra, words):
    from megafixed.config import load_config
    from megafixed.parallel.layout import LayoutError
    from megafixed.run_plan import RunPlan

    cfg = load_config(None, ["model.n_layers=2", "model.n_heads=4", "model.d_model=64", "data.seq_len=32",
                             "model.max_seq_len=32", "parallel.cp=2", "train.global_batch=8", "train.micro_batch=4",
                             *extra])
    with pytest.raises(LayoutError) as err:
        RunPlan.build(cfg, 4)
    msg = str(err.value)
    assert all(w in msg for w in words) and "\n" not in msg, msg
