"""A long run survives bad steps, hangs and slow ranks, and says which (``faults.inject`` drills).

* ``nan@3`` with ``guard.on_nonfinite=skip``: checkpoints 2 and 3 hold the same weights and Adam state;
  on DP2 with the NaN on rank 1 only, both ranks skip and the later losses equal the one-process run's;
* ``spike@6:factor=1000`` with ``guard.on_spike=rollback``: the run reloads step 4 and its later losses
  equal, bit for bit, a fresh run given ``data.skip_steps=5-6``; a requeue from before the window skips it;
* one shared 2-rank launch also drills ``slow:rank=1:factor=3`` (rank 1 and its host named) and
  ``hang@8:rank=1`` with ``watchdog.timeout_s=20`` (exit 76 within the timeout + 30 s, a stack file
  per rank, rank 1 named);
* no false verdict over 300 steps shaped like the quickstart's (its optimizer, schedule and clipping;
  the tiny model, so it is cheap), with the guard's defaults;
* a refused config is never lost under torchrun (20 launches).
Every fault leaves the last good checkpoint loadable, verified.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from _train_data import tiny_overrides
from megafixed import exit_codes
from megafixed.config import load_config
from megafixed.run import manifest

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTED = ("validation.interval=0", "checkpoint.keep=0")


def _train(prefix, run_dir, *extra, inject=None, monkeypatch=None):
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.trainer import train

    drill = [f"faults.inject={inject}"] if inject is not None else []
    cfg = load_config(None, tiny_overrides(prefix, run_dir, *CHECKPOINTED, *extra, *drill))
    return train(cfg, setup_distributed(RunPlan.for_launch(cfg)), log=lambda *_: None)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def verdicts(run_dir: Path) -> list[dict]:
    return [r["bad_step"] for r in records(run_dir) if "bad_step" in r]


def assert_latest_verifies(run_dir: Path) -> str:
    tag = (Path(run_dir) / "checkpoints" / "latest").read_text().strip()
    assert manifest.verify_for_reading(Path(run_dir) / "checkpoints" / tag) is not None
    return tag


def _tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k], f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]")


def _state(tag_dir: Path) -> dict:
    model = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)
    optim = torch.load(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    opt = optim["optimizer_state_dict"]
    return dict(_tensors({"module": model["module"], "adam": opt["base_optimizer_state"]["state"],
                          "fp32": opt["single_partition_of_fp32_groups"]}))


NAN_RUN = ("train.max_steps=10", "guard.on_nonfinite=skip", "checkpoint.interval=1")  # as the DP2 drill: one schedule


@pytest.fixture(scope="module")
def one_process_nan(tiny_shards, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    try:
        run = tmp_path_factory.mktemp("nan_one") / "run"
        _train(tiny_shards, run, *NAN_RUN, inject="nan@3", monkeypatch=mp)
        return run
    finally:
        mp.undo()


def test_nan_skip_keeps_weights_and_adam_state(one_process_nan):
    run = one_process_nan
    (v,) = verdicts(run)
    assert (v["step"], v["kind"], v["what"], v["action"]) == (3, "nonfinite", "loss", "skip")
    assert json.loads((run / "faults" / "bad_steps.jsonl").read_text().splitlines()[0])["step"] == 3
    two, three, four = (_state(run / "checkpoints" / f"step_0000000{s}") for s in (2, 3, 4))
    assert two.keys() == three.keys() and len(two) > 10
    for name in two:
        assert torch.equal(two[name], three[name]), name  # the update of step 3 was dropped, bit for bit
    assert any(not torch.equal(three[n], four[n]) for n in three)  # and step 4 trained again
    rec = {r["step"]: r for r in records(run) if "loss" in r}
    assert rec[3]["consumed_samples"] == 3 * 8  # the batch counts as consumed
    tag = assert_latest_verifies(run)
    assert json.loads((run / "checkpoints" / tag / "run.json").read_text())["fault_injection"] == "nan@3"


def _launch(nproc: int, args: list[str], env: dict, timeout: float):
    """torchrun on loopback, reading its output as it comes: (returncode, text, {line: arrival time})."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={port}", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, lines = {}, []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        seen.setdefault(line.strip(), time.monotonic())
        if time.monotonic() > deadline:
            proc.kill()
    proc.wait()
    return proc.returncode, "".join(lines), seen, time.monotonic()


@pytest.fixture(scope="module")
def dp2_drill(tiny_shards, tmp_path_factory):
    """One 2-rank launch: NaN on rank 1 at step 3 (skip), rank 1 three times slower, rank 1 hangs at 8."""
    run = tmp_path_factory.mktemp("dp2") / "run"
    cfg = run.parent / "empty.yaml"
    cfg.write_text("{}\n")
    args = ["-m", "megafixed.cli", "train", str(cfg),
            *tiny_overrides(tiny_shards, run, *CHECKPOINTED, "train.max_steps=10", "guard.on_nonfinite=skip",
                            "checkpoint.interval=2", "watchdog.timeout_s=20", "train.micro_batch=4",
                            "faults.inject=nan@3:rank=1;slow:rank=1:factor=3;hang@8:rank=1")]
    code, text, seen, ended = _launch(2, args, {}, timeout=400)
    return run, code, text, seen, ended


@pytest.mark.multiprocess
def test_dp2_nan_on_one_rank_skips_on_both(dp2_drill, one_process_nan):
    run, _, text, _, _ = dp2_drill
    assert "dp 2" in text and "bad step 3: the loss is nan" in text
    a, b = losses(one_process_nan), losses(run)
    for step in (1, 2, 4, 5, 6, 7):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    assert [v["step"] for v in verdicts(run)] == [3]


@pytest.mark.multiprocess
def test_dp2_slow_rank_is_named_with_its_host(dp2_drill):
    run, _, text, _, _ = dp2_drill
    host = socket.gethostname()
    assert f"straggler at step 2: rank 1 on {host}" in text
    rec = [r for r in records(run) if "rank_compute_s" in r]
    assert rec and all(len(r["rank_compute_s"]) == 2 and len(r["rank_wait_s"]) == 2 for r in rec)
    named = [r for r in rec if r["stragglers"]]
    assert len(named) >= len(rec) - 1 and all([s["rank"] for s in r["stragglers"]] == [1] for r in named)
    assert all(r["rank_compute_s"][1] > 1.5 * r["rank_compute_s"][0] for r in named)
    # the line points at the faults/ file, written before it (metrics.jsonl is truncated by a resume; it is not)
    assert f"(stragglers.factor); recorded in {run / 'faults' / 'stragglers.jsonl'}" in text
    kept = [json.loads(line) for line in (run / "faults" / "stragglers.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [r["step"] for r in named] and 2 in [r["step"] for r in kept]
    assert all(k["stragglers"] == r["stragglers"] for k, r in zip(kept, named))


@pytest.mark.multiprocess
def test_dp2_hang_is_named_and_exits_hung(dp2_drill):
    run, code, text, seen, ended = dp2_drill
    assert code != 0 and f"exitcode  : {exit_codes.HUNG}" in text, text[-3000:]
    step7 = next(t for line, t in seen.items() if line.startswith("step 7/10"))
    assert ended - step7 < 20 + 30
    stacks = sorted((run / "faults").glob("hang.step00000008.rank*.txt"))
    assert [p.name.split(".")[2] for p in stacks] == ["rank00000", "rank00001"]
    assert "before_step" in stacks[1].read_text()  # rank 1's main thread, caught where it hangs
    assert f"rank 1 on {socket.gethostname()} never reached step 8" in text
    assert assert_latest_verifies(run) == "step_00000006"


ROLLBACK = ("train.max_steps=9", "checkpoint.interval=2", "guard.spike_window=4", "guard.rollback_skip=0")


def test_spike_rollback_equals_fresh_skip_and_survives_a_requeue(tiny_shards, tmp_path, monkeypatch):
    rolled, fresh = tmp_path / "rolled", tmp_path / "fresh"
    _train(tiny_shards, rolled, *ROLLBACK, "guard.on_spike=rollback", inject="spike@6:factor=1000",
           monkeypatch=monkeypatch)
    (v,) = verdicts(rolled)
    assert (v["step"], v["kind"], v["what"], v["action"]) == (6, "spike", "loss", "rollback")
    window = json.loads((rolled / "faults" / "skipped_steps.json").read_text())["windows"]
    assert [(w["first"], w["last"]) for w in window] == [(5, 6)]  # from checkpoint 4 to the bad step
    _train(tiny_shards, fresh, *ROLLBACK, "data.skip_steps=5-6", monkeypatch=monkeypatch)
    a, b = losses(rolled), losses(fresh)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 7, 8, 9]
    assert all(a[s] == b[s] for s in a)  # bit for bit
    assert_latest_verifies(rolled)
    # A requeue whose newest checkpoint precedes the window (latest back on step 4) skips it again.
    ckpts = rolled / "checkpoints"
    for tag in ("step_00000006", "step_00000008", "step_00000009"):
        import shutil

        shutil.rmtree(ckpts / tag)
    (ckpts / "latest").write_text("step_00000004\n")
    _train(tiny_shards, rolled, *ROLLBACK, "guard.on_spike=rollback", monkeypatch=monkeypatch)
    again = losses(rolled)
    assert all(again[s] == b[s] for s in (7, 8, 9))
    assert [r["step"] for r in records(rolled) if r.get("skipped_data")] == [5, 6]


@pytest.mark.slow
def test_no_false_verdict_over_a_quickstart_shaped_run(tiny_shards, tmp_path, monkeypatch):
    """300 steps with the quickstart's optimizer, schedule and clipping and the guard's defaults
    (window 128, 6 sigma; default action skip): not one verdict."""
    run = tmp_path / "qs"
    _train(tiny_shards, run, "train.max_steps=300", "checkpoint.interval=1000", "train.global_batch=4",
           "train.micro_batch=4", "optimizer.lr=2e-3", "optimizer.min_lr=2e-4", "optimizer.weight_decay=0.1",
           "optimizer.grad_clip=1.0", "schedule.kind=cosine", "schedule.warmup_steps=30", monkeypatch=monkeypatch)
    recs = records(run)
    assert len([r for r in recs if "loss" in r]) == 300 and verdicts(run) == []
    assert not (run / "faults" / "bad_steps.jsonl").exists()


def test_malformed_injection_is_one_line(tmp_path):
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    proc = subprocess.run([sys.executable, "-m", "megafixed.cli", "train", str(cfg), "data.mock=true",
                           f"train.run_dir={tmp_path / 'run'}", "faults.inject=nan@three"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == exit_codes.BAD_INPUT
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "faults.inject='nan@three'" in errors[0] and "not a number" in errors[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("launches", [4, pytest.param(20, marks=pytest.mark.extended)])
def test_a_refusal_is_in_every_torchrun_log(tmp_path, launches):
    """When rank 1 refuses first, torchrun ends rank 0; rank 0's line must be out by then. The default run
    makes 4 concurrent launches; the race-hunting 20 are in the extended set (the same race, more tries)."""
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    args = ["-m", "megafixed.cli", "train", str(cfg), "train.bogus_key=1", f"train.run_dir={tmp_path / 'run'}"]

    def one(_):
        return _launch(2, args, {}, timeout=180)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(launches)))
    # rank 0's line (or, had rank 0 been over the grace late, rank 1's own "error: rank 1: ..." line)
    found = [len([ln for ln in text.splitlines() if ln.startswith("error:") and
                  "unknown config key 'train.bogus_key'" in ln]) for _, text, _, _ in results]
    assert all(n >= 1 for n in found), [t[-1500:] for (_, t, _, _), n in zip(results, found) if n < 1][:1]
    assert all(f"exitcode  : {exit_codes.BAD_INPUT}" in text for _, text, _, _ in results)


def test_a_rank_that_dies_loses_no_checkpoint(tiny_shards, tmp_path, monkeypatch):
    """``exit@5``: the process is SIGKILLed before step 5; checkpoint 4 verifies and the run resumes from it."""
    run, cfg = tmp_path / "run", tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    over = tiny_overrides(tiny_shards, run, *CHECKPOINTED, "train.max_steps=6", "checkpoint.interval=2")
    proc = subprocess.run([sys.executable, "-m", "megafixed.cli", "train", str(cfg), *over, "faults.inject=exit@5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9 and "rank 0 dies (SIGKILL) before step 5" in proc.stderr
    assert assert_latest_verifies(run) == "step_00000004"
    result = _train(tiny_shards, run, "train.max_steps=6", "checkpoint.interval=2", monkeypatch=monkeypatch)
    assert result.resumed_from == "step_00000004" and result.step == 6


@pytest.mark.multiprocess
def test_the_hung_dp2_run_goes_on_with_one_rank_and_says_it_shrank(dp2_drill, one_process_nan, tiny_shards,
                                                                   monkeypatch):
    """The drill's run (hung at step 8, last checkpoint 6 from dp 2) resumes on one process: the data-
    parallel degree is re-laid out, the global batch kept by accumulating more, and the log and the
    run record say the job shrank; its losses are the uninterrupted one-process run's (within 1e-5)."""
    run = dp2_drill[0]
    lines: list[str] = []
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.trainer import train

    cfg = load_config(None, tiny_overrides(tiny_shards, run, *CHECKPOINTED, "train.max_steps=10",
                                           "guard.on_nonfinite=skip", "checkpoint.interval=2", "train.micro_batch=4"))
    result = train(cfg, setup_distributed(RunPlan.for_launch(cfg)), log=lines.append)
    assert result.resumed_from == "step_00000006" and result.step == 10
    shrank = [ln for ln in lines if ln.startswith("the job shrank")]
    assert len(shrank) == 1 and "written by 2 ranks" in shrank[0] and "accumulating 2 micro batches" in shrank[0]
    record = json.loads((run / "checkpoints" / "step_00000010" / "run.json").read_text())
    assert record["shrunk_from"]["world"] == 2 and record["layout"]["dp"] == 1
    a, b = losses(one_process_nan), losses(run)
    for step in (7, 8, 9, 10):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step


def test_a_spike_after_max_rollbacks_stops_the_run_with_the_checkpoint_intact(tiny_shards, tmp_path, monkeypatch):
    """``guard.max_rollbacks=1``: the spike at step 6 rolls back to step 4; the next one, at step 8, finds the
    rollbacks used up and stops the run in one line (exit 1 from the CLI), its newest checkpoint verified."""
    from megafixed.train.callbacks.guard.rollback import BadStepError

    run = tmp_path / "run"
    with pytest.raises(BadStepError, match=r"bad step 8: .* already rolled back 1 time\(s\) \(guard.max_rollbacks=1\)"):
        _train(tiny_shards, run, *ROLLBACK, "guard.on_spike=rollback", "guard.max_rollbacks=1",
               inject="spike@6:factor=1000;spike@8:factor=1000", monkeypatch=monkeypatch)
    assert [(v["step"], v["action"]) for v in verdicts(run)] == [(6, "rollback"), (8, "rollback")]
    window = json.loads((run / "faults" / "skipped_steps.json").read_text())["windows"]
    assert [(w["first"], w["last"]) for w in window] == [(5, 6)]  # one rollback, no second window
    assert sorted(losses(run)) == [1, 2, 3, 4, 7]  # 5-6 skipped; the stopping step 8 is not a trained step
    assert assert_latest_verifies(run) == "step_00000006"  # saved after the rollback, before the stopping spike
