"""Context parallelism (Ulysses) on the torch engine, against one process, through ``megafixed train``.

Each world is one launch of ``native_cp_worker.py`` running several trainer runs (imports paid once):

- 2 ranks: ``cp2`` (GF(2) code, with in-loop zero-shot evaluation), ``cp2_learned`` (the learned
  table), and ``victim``: ``cp2``'s command SIGKILLed on every rank before step 3
  (``faults.inject=exit@3``), which ends the launch;
- one process: the references ``gf2`` (with the same in-loop evaluation) and ``learned``, and
  ``cp2_to_cp1``: ``cp2``'s step-2 checkpoint resumed on one process;
- 2 ranks again: the victim's command rerun, and ``cp1_to_cp2``: ``gf2``'s step-2 checkpoint resumed
  at CP2;
- 4 ranks: ``cp4_learned``, ``cp4_fused`` (GF(2) with the fused first layer), ``cp2_tp2`` (with
  sequence parallelism), ``cp2_dp2`` (FSDP2 over dp_shard x cp), ``cp2_hsdp`` (dp_replicate 2) and
  ``cp2_pp2`` (1F1B).

Asserted: every layout's losses, gradient norms and validation losses within 1e-5 of one process;
the in-loop zero-shot numbers at CP2 equal one process's; the resumes (weights and Adam's state
re-laid out by DCP) within 1e-5 of the uninterrupted one-process run; the killed run's rerun bit for
bit; the guard's inputs with the same bits on every rank. The refusals run in-process (``RunPlan.build``).
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _env import launch_free_env
from _launch import torchrun_cmd
from _metrics import assert_rows_match, read_metrics
from _train_data import tiny_overrides, write_shards

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "native_cp_worker.py")
RTOL = 1e-5
STEPS = 4
RUN = ("train.engine=torch", f"train.max_steps={STEPS}", "checkpoint.interval=2", "checkpoint.keep=0",
       "validation.interval=2", "schedule.warmup_steps=1", "optimizer.grad_clip=0.05",
       "model.vocab_size=512", "model.code_bits=9")
EVAL = ("eval.tasks=[piqa]", f"eval.interval={STEPS}", "eval.limit=4", "eval.batch_size=2")


def _env() -> dict:
    return launch_free_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _launch(nproc: int, tmp: Path, name: str, runs: list) -> tuple[subprocess.CompletedProcess, dict]:
    spec, out = tmp / f"{name}.json", tmp / f"{name}.out.json"
    spec.write_text(json.dumps({"runs": runs}))
    args = [WORKER, str(spec), str(out)]
    cmd = [sys.executable, *args] if nproc == 1 else torchrun_cmd(nproc, args)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    print(f"launch {name} ({nproc} ranks): {time.perf_counter() - t0:.1f} s")  # shown with -s: the cost of each
    return proc, (json.loads(out.read_text()) if out.exists() else {})


def _ok(launch: tuple) -> dict:
    proc, results = launch
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return results


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Token shards (ids < 256) and a 512-token BPE (the in-loop evaluation tokenizes its tasks)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import _eval_model as E

    root = tmp_path_factory.mktemp("cp_data")
    return write_shards(root / "data"), E.make_tokenizer(root)


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """Every launch of the module doc, in order (a resume needs its source's checkpoint first)."""
    tmp = tmp_path_factory.mktemp("native_cp")
    prefix, tok = data
    names = ("cp2", "cp2_learned", "victim", "gf2", "learned", "cp2_to_cp1", "cp1_to_cp2", "cp4_learned",
             "cp4_fused", "cp2_tp2", "cp2_dp2", "cp2_hsdp", "cp2_pp2")
    d = {n: tmp / n for n in names}

    def run(name, kind, *extra, rewind=None, inject=None, run_dir=None):
        overrides = tiny_overrides(prefix, run_dir or d[name], f"model.input={kind}", f"data.tokenizer={tok}",
                                   *RUN, *extra)
        return {"name": name, "overrides": overrides, "rewind": rewind, "inject": inject}

    cp2 = ("parallel.cp=2", *EVAL)
    w: dict = {}
    proc, w2 = _launch(2, tmp, "two", [run("cp2", "gf2", *cp2), run("cp2_learned", "learned", "parallel.cp=2"),
                                       run("victim", "gf2", *cp2, inject="exit@3")])
    assert proc.returncode != 0 and "dies (SIGKILL) before step 3" in proc.stderr, \
        proc.stdout[-3000:] + proc.stderr[-6000:]
    w.update(w2)
    w.update(_ok(_launch(1, tmp, "one", [run("gf2", "gf2", *EVAL), run("learned", "learned"),
                                         run("cp2_to_cp1", "gf2", rewind=[str(d["cp2"]), "step_00000002"])])))
    rerun = run("victim", "gf2", *cp2)
    rerun["name"] = "rerun"
    w.update(_ok(_launch(2, tmp, "again", [rerun, run("cp1_to_cp2", "gf2", "parallel.cp=2",
                                                      rewind=[str(d["gf2"]), "step_00000002"])])))
    w.update(_ok(_launch(4, tmp, "four", [
        run("cp4_learned", "learned", "parallel.cp=4"),
        run("cp4_fused", "gf2", "parallel.cp=4", "model.fused_first_layer=true"),
        run("cp2_tp2", "gf2", "parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
            "model.fused_first_layer=true"),
        run("cp2_dp2", "gf2", "parallel.cp=2", "train.activation_checkpointing=true"),
        run("cp2_hsdp", "learned", "parallel.cp=2", "torch_engine.dp_replicate=2"),
        run("cp2_pp2", "gf2", "parallel.cp=2", "parallel.pp=2")])))
    return {"dirs": d, "worker": w}


def _assert_like(got_dir: Path, want_dir: Path, what: str, first: int = 0) -> None:
    """Training rows ``first + 1 .. STEPS``, and the validations among them, alike within RTOL."""
    got = read_metrics(got_dir, "loss")
    want = [r for r in read_metrics(want_dir, "loss") if r["step"] > first]
    assert [r["step"] for r in got if r["step"] > first] == list(range(first + 1, STEPS + 1)), what
    assert_rows_match([r for r in got if r["step"] > first], want, what, rtol=RTOL)
    vals = [(r["step"], r["val_loss"]) for r in read_metrics(got_dir, "val_loss") if r["step"] > first]
    ref = {r["step"]: r["val_loss"] for r in read_metrics(want_dir, "val_loss")}
    assert [s for s, _ in vals] == [s for s in ref if s > first], f"{what}: validations {vals}"
    for step, v in vals:
        assert math.isclose(v, ref[step], rel_tol=RTOL), f"{what}: validation at step {step} {v} vs {ref[step]}"


LAYOUTS = [("cp2", "gf2", "tp 1 x cp 2 x pp 1 x dp 1"), ("cp2_learned", "learned", "tp 1 x cp 2 x pp 1 x dp 1"),
           ("cp4_learned", "learned", "tp 1 x cp 4 x pp 1 x dp 1"), ("cp4_fused", "gf2", "tp 1 x cp 4 x pp 1 x dp 1"),
           ("cp2_tp2", "gf2", "tp 2 x cp 2 x pp 1 x dp 1"), ("cp2_dp2", "gf2", "tp 1 x cp 2 x pp 1 x dp 2"),
           ("cp2_hsdp", "learned", "tp 1 x cp 2 x pp 1 x dp 2"), ("cp2_pp2", "gf2", "tp 1 x cp 2 x pp 2 x dp 1")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,ref,words", LAYOUTS, ids=[n for n, _, _ in LAYOUTS])
def test_a_context_parallel_layout_equals_one_process(runs, name, ref, words):
    r = runs["worker"][name]
    assert words in r["describe"], r["describe"]
    one = read_metrics(runs["dirs"][ref], "loss")
    assert [row["step"] for row in one] == list(range(1, STEPS + 1))
    assert all(row["grad_norm"] > 0.05 for row in one)  # every step clipped: the norm had to be right
    _assert_like(runs["dirs"][name], runs["dirs"][ref], name)
    # every step judged twice (the loss, then the norm) with the same bits on every rank
    assert [(s, what) for s, what, _ in r["judged"]] == [(s, w) for s in range(1, STEPS + 1)
                                                         for w in ("loss", "grad_norm")], r["judged"]
    assert r["same_bits_on_every_rank"], name


@pytest.mark.multiprocess
def test_in_loop_zero_shot_numbers_at_cp2_equal_one_process(runs):
    got = [r for r in read_metrics(runs["dirs"]["cp2"]) if any(k.startswith("eval/") for k in r)]
    want = [r for r in read_metrics(runs["dirs"]["gf2"]) if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in got] == [r["step"] for r in want] == [STEPS]
    keys = sorted(k for k in want[0] if k.startswith("eval/"))
    assert keys and keys == sorted(k for k in got[0] if k.startswith("eval/")), (got, want)
    for k in keys:
        assert math.isclose(got[0][k], want[0][k], rel_tol=RTOL), (k, got[0][k], want[0][k])
    assert math.isfinite(want[0]["eval/piqa/acc"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,change", [("cp2_to_cp1", r"parallel\.cp:? 2 -> 1"),
                                                  ("cp1_to_cp2", r"parallel\.cp:? 1 -> 2")])
def test_a_checkpoint_resumes_at_another_cp_with_the_optimizer(runs, name, change):
    r = runs["worker"][name]
    assert r["resumed_from"] == "step_00000002" and r["step"] == STEPS, r
    line = next(ln for ln in r["lines"] if ln.startswith("resumed from"))
    assert re.search(change, line), line  # a change the resume names, and allows (DCP reshards)
    _assert_like(runs["dirs"][name], runs["dirs"]["gf2"], name, first=2)  # steps 3-4 in the other layout
    rows = read_metrics(runs["dirs"][name], "loss")
    assert rows[-1]["loss"] < read_metrics(runs["dirs"]["gf2"], "loss")[0]["loss"]


@pytest.mark.multiprocess
def test_a_cp2_run_killed_mid_run_reruns_bit_identically(runs):
    r = runs["worker"]["rerun"]
    assert r["resumed_from"] == "step_00000002", r
    keys = ("step", "loss", "grad_norm", "consumed_samples", "lr")
    got, want = read_metrics(runs["dirs"]["victim"], "loss"), read_metrics(runs["dirs"]["cp2"], "loss")
    assert [row["step"] for row in want] == list(range(1, STEPS + 1))
    assert [{k: row[k] for k in keys} for row in got] == [{k: row[k] for k in keys} for row in want]
    assert [row["val_loss"] for row in read_metrics(runs["dirs"]["victim"], "val_loss")] == \
        [row["val_loss"] for row in read_metrics(runs["dirs"]["cp2"], "val_loss")]


@pytest.mark.multiprocess
def test_a_cp2_checkpoint_loads_as_the_plain_model_eval_and_generate_use(runs):
    """``megafixed eval``/``generate`` read a run through ``load_trained_model``: a plain one-process GPT,
    whatever cp the run trained at (parameter names and shapes do not depend on it)."""
    import torch

    from megafixed.engine.trained import load_trained_model

    cp2, _ = load_trained_model(None, runs["dirs"]["cp2"], "step_00000004")
    one, _ = load_trained_model(None, runs["dirs"]["gf2"], "step_00000004")
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = cp2(ids[:, :-1], ids[:, 1:]).item(), one(ids[:, :-1], ids[:, 1:]).item()
    assert math.isclose(got, want, rel_tol=RTOL), (got, want)


# ------------------------------------------------------------------------------------------ refusals
def _plan(world: int, *overrides: str):
    from megafixed.config import load_config
    from megafixed.run_plan import RunPlan

    cfg = load_config(None, ["train.engine=torch", "model.vocab_size=256", "model.d_model=64", "model.n_layers=2",
                             "model.max_seq_len=64", "data.seq_len=64", "train.global_batch=8",
                             "train.micro_batch=1", *overrides])
    return RunPlan.build(cfg, world)


def test_heads_that_do_not_split_over_cp_are_refused_naming_the_largest_cp():
    from megafixed.parallel.layout import LayoutError

    with pytest.raises(LayoutError) as e:
        _plan(6, "model.n_heads=4", "parallel.cp=3", "data.seq_len=48", "model.max_seq_len=48")
    msg = str(e.value)
    assert "parallel.cp=3" in msg and "the largest parallel.cp that works is 2" in msg and "\n" not in msg, msg
    with pytest.raises(LayoutError, match="largest parallel.cp that works is 2 "):  # 2 heads per TP rank, cp 4
        _plan(8, "model.n_heads=4", "parallel.tp=2", "parallel.cp=4")
    assert _plan(4, "model.n_heads=4", "parallel.cp=4").cp == 4  # 4 heads, 4 ranks: one head each


def test_ring_attention_is_refused_on_cpu_naming_ulysses():
    from megafixed.parallel.layout import LayoutError

    with pytest.raises(LayoutError, match="parallel.cp_method=ulysses"):
        _plan(2, "parallel.cp=2", "parallel.cp_method=ring")
