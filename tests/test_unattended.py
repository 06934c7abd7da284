"""A run nobody watches: it keeps its evidence, goes on past a damaged checkpoint, refuses drills that
cannot fire, and tells a transient fault from a deterministic one (issue 43, ``faults.inject`` drills).

* ``nan@5:once`` with the re-check: nothing skipped, weights and Adam state at step 8 bit-identical to a
  fault-free run's, on both engines; the record says transient. ``nan@5`` (it repeats): skipped exactly as
  without the re-check. On DP2 ``spike@5:once:rank=1`` names rank 1, and with
  ``guard.max_transient_faults=1`` the run saves and exits 77 with its node in ``faults/exclude_nodes.txt``;
  the job script resubmits the job with ``--exclude``.
* a damaged newest checkpoint: a resume, a 2-rank requeue and a rollback each load the one before it, say so,
  and keep the damaged tag as ``<tag>.damaged-corrupt``; all damaged: one line, exit 2, nothing moved.
* evidence: ``hang@2:rank=1`` before any checkpoint keeps the stacks and ``metrics.jsonl`` (exit 76); a crash at
  step 5 keeps the metrics; a rerun there starts fresh and keeps the first attempt under ``attempts/1/``.
* a hang on the first step after a requeue is named before gloo's own timeout (``parallel.collective_timeout_s``).
* drills that cannot fire (a rank not below the world size, a step past ``train.max_steps``, a step done): exit 2.
Nothing here races the clock: timeouts are bounds, and each fault fires at a known step.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from test_resilience import _launch, _tensors  # a torchrun launch read as it comes; a checkpoint's tensors

from _metrics import raw_scalars
from _train_data import tiny_overrides
from megafixed import exit_codes
from megafixed.config import load_config
from megafixed.run import faults

ROOT = Path(__file__).resolve().parent.parent
BASE = ("validation.interval=0", "checkpoint.keep=0", "train.max_steps=8", "checkpoint.interval=4")
TAG4, TAG8 = "step_00000004", "step_00000008"


def _train(shards, run_dir, *extra, inject=None, lines=None):
    """One in-process ``train`` of the tiny model (``BASE`` first, ``extra`` overrides it)."""
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.trainer import train

    drill = [f"faults.inject={inject}"] if inject is not None else []
    cfg = load_config(None, tiny_overrides(shards, run_dir, *BASE, *extra, *drill))
    return train(cfg, setup_distributed(RunPlan.for_launch(cfg)),
                 log=lines.append if lines is not None else (lambda *_: None))


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in _records(run_dir) if "loss" in r}


def _faults(run_dir, name="bad_steps.jsonl") -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "faults" / name).read_text().splitlines()]


def _state(tag_dir: Path, scratch: Path) -> dict:
    """Every tensor of a checkpoint's weights and optimizer state, by name, for either engine's files."""
    if (tag_dir / "mp_rank_00_model_states.pt").exists():
        model = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)
        opt = torch.load(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
        opt = opt["optimizer_state_dict"]
        return dict(_tensors({"module": model["module"], "adam": opt["base_optimizer_state"]["state"],
                              "fp32": opt["single_partition_of_fp32_groups"]}))
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{tag_dir.parent.parent.name}-{tag_dir.name}.pt"
    dcp_to_torch_save(str(tag_dir), str(out))
    saved = torch.load(out, weights_only=False)
    return dict(_tensors({k: v for k, v in saved.items() if k in ("model", "optimizer")}))


def _same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bit for bit


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def _model_file(tag_dir: Path) -> Path:
    return next(p for p in sorted(tag_dir.iterdir()) if p.name.startswith(("mp_rank_", "__0_")))


# ----------------------------------------------------------------------------------- the pieces alone
def test_once_faults_hit_the_first_computation_only_and_drills_that_cannot_fire_are_named():
    got = faults.parse("nan@5:once;spike@6:rank=1:once:factor=10;nan@7")
    assert [(f.kind, f.step, f.rank, f.factor, f.once) for f in got] == [
        ("nan", 5, None, 1.0, True), ("spike", 6, 1, 10.0, True), ("nan", 7, None, 1.0, False)]
    assert [f.spelled() for f in got] == ["nan@5:once", "spike@6:rank=1:factor=10:once", "nan@7"]
    for bad in ("hang@3:once", "exit@3:once", "slow:once", "nan@3:once=1"):
        with pytest.raises(faults.InjectError, match="unknown option"):
            faults.parse(bad)
    plan = faults.FaultPlan(got, rank=1)
    seen = []
    for step in (5, 5, 6, 6, 7, 7):  # each step computed twice, as a re-check does
        plan.before_step(step)
        seen.append(plan.loss_factor(step))
    assert seen[0] != seen[0] and seen[1] is None  # nan@5:once: the first computation only (NaN != NaN)
    assert seen[2:4] == [10.0, None]
    assert all(v != v for v in seen[4:])  # nan@7 (not once): every computation
    # A fault that cannot fire in this run is named, with why: rank, max_steps, a step already done.
    plan = faults.FaultPlan(faults.parse("nan@3:rank=5;nan@99;spike@2;slow:rank=1"), rank=0)
    line = plan.refusal(world=2, max_steps=8, done=2)
    assert "\n" not in line and "'nan@3:rank=5' cannot fire: rank 5 is not below the world size 2" in line
    assert "'nan@99' cannot fire: step 99 is beyond train.max_steps=8" in line
    assert "'spike@2:factor=1000' cannot fire: step 2 is already done: this run resumes after step 2" in line
    assert "'slow:rank=1:factor=3' cannot" not in line and plan.refusal(world=6, max_steps=99, done=0) is None


def test_a_requeue_of_the_same_drill_goes_on_past_its_done_steps(tmp_path):
    """A resumed checkpoint written under the same ``faults.inject`` is that drill's own requeue: its earlier
    faults have had their turn, so only a new drill is refused for steps already done."""
    from megafixed.train.callbacks.drills import Drills
    from megafixed.train.checkpoint import ResumePoint

    tag_dir = tmp_path / "checkpoints" / "step_00000006"
    tag_dir.mkdir(parents=True)
    (tag_dir / "run.json").write_text(json.dumps({"config": {}, "fault_injection": "nan@3:once"}))
    point = ResumePoint(tag=tag_dir.name, tag_dir=tag_dir)
    assert Drills("nan@3:once", 8)._done(point) == 0 and Drills("nan@3:once", 8)._done(None) == 0
    assert Drills("nan@3", 8)._done(point) == 6


def test_a_failed_run_removes_only_its_own_start_and_a_fresh_start_sets_an_attempt_aside(tmp_path):
    from megafixed.train.evidence import RunFiles, set_aside_earlier_attempt

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("a: 1\n")
    made = RunFiles(run, created=True)
    assert made.after_failure() is None and not run.exists()  # failed before its first step: nothing to keep
    run.mkdir()
    (run / "config.yaml").write_text("a: 1\n")
    made = RunFiles(run, created=True)
    made.first_step()
    assert made.after_failure() is None and not run.exists()  # nothing new since: its own start only
    run.mkdir()
    (run / "config.yaml").write_text("a: 1\n")
    made = RunFiles(run, created=True)
    made.first_step()
    (run / "faults").mkdir()
    (run / "faults" / "hang.step00000002.rank00000.h.txt").write_text("stacks")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    kept = made.after_failure()
    assert kept and str(run) in kept and "faults/" in kept and "metrics.jsonl" in kept
    assert (run / "faults" / "hang.step00000002.rank00000.h.txt").read_text() == "stacks"
    # a fresh start there (no checkpoint): the attempt's files go to attempts/1, slurm/ and the lock stay
    (run / "slurm").mkdir()
    (run / ".megafixed.lock").write_text("me")
    said = []
    assert set_aside_earlier_attempt(run, said.append) == run / "attempts" / "1"
    assert sorted(p.name for p in run.iterdir()) == [".megafixed.lock", "attempts", "slurm"]
    assert (run / "attempts" / "1" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert len(said) == 1 and "attempts/1" in said[0] and "starts fresh" in said[0]
    (run / "metrics.jsonl").write_text("{}\n")
    assert set_aside_earlier_attempt(run, said.append) == run / "attempts" / "2"  # never onto an earlier one
    assert set_aside_earlier_attempt(run, said.append) is None


def test_the_first_step_ends_before_the_collective_timeout(tmp_path):
    """A rank hung before its first step leaves the others in a collective that gloo ends after
    ``parallel.collective_timeout_s``: the first step's allowance must end before it, not with it."""
    from megafixed.train.watchdog import HangWatchdog

    def first(hang_s, collective_s):
        return HangWatchdog(timeout_s=hang_s, slow_phase_s=collective_s, faults_dir=tmp_path, rank=0,
                            world=1).first_step_s()

    assert first(20, 40) == 30 and first(20, 600) == 590 and first(0, 600) == 590  # auto: 300 s floor
    assert first(900, 600) == 900  # a longer hang timeout is the user's own choice
    assert all(first(h, c) < c for h, c in ((20, 40), (5, 20), (1, 4), (0, 600)))


class _Clock:
    """The watchdog's ``time``, advanced only by its own sleeps: no test here waits on the machine's clock."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.now += s


class _SilentStore:
    """A store on which a rank that cannot answer (SIGSTOP) never reports its stacks."""

    def check(self, keys):
        return False

    def set(self, key, value):
        pass


def test_a_rank_that_cannot_answer_does_not_push_the_first_steps_hang_line_past_the_collective_timeout(
        tmp_path, monkeypatch):
    from megafixed.train import watchdog as wd

    clock = _Clock()
    monkeypatch.setattr(wd, "time", clock)
    w = wd.HangWatchdog(timeout_s=20, slow_phase_s=40, faults_dir=tmp_path, rank=0, world=2,
                        store=_SilentStore(), done=4)  # a requeue resumed at step 4: its first step is 5
    began = clock.now
    clock.now = w.deadline  # the first step's allowance is over: 30 s, 10 s ahead of gloo's 40
    w._progress()  # rank 0 waits for the stack files that rank 1 never writes
    assert clock.now - began < 40 - 2, clock.now - began  # named before the collective timeout, with room to print
    assert clock.now - began >= 34  # and it did wait for them, half the margin
    w.enter(5), w.finish(5, 0.1)
    fired = clock.now
    w._progress()  # after the first step: the full gather
    assert clock.now - fired >= wd.GATHER_S


def test_the_job_script_resubmits_itself_without_the_nodes_on_exit_77(tmp_path):
    """The rendered script run by bash with stand-ins for srun/scontrol/sbatch: after srun ends 77 it submits
    the same script again with every listed node excluded, to start after this job; 76 still requeues."""
    from megafixed.launch.sbatch import JobSpec, render

    bin_dir, run_dir = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    (run_dir / "faults").mkdir(parents=True)
    (run_dir / "faults" / "exclude_nodes.txt").write_text("node2\nnode5\n")
    calls = tmp_path / "calls"
    stubs = {"srun": 'exit "$SRUN_RC"',
             "scontrol": textwrap.dedent("""\
                 echo "scontrol $*" >> "$CALLS"
                 case "$1 $2" in
                   "show hostnames") echo node1; echo node2 ;;
                   "show job") echo "   Command=/runs/x/slurm/job-1.sbatch" ;;
                 esac"""),
             "sbatch": 'echo "sbatch $*" >> "$CALLS"; echo 4321',
             "python": 'echo 10.0.0.1'}  # megafixed.launch.head: the head node's address
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    spec = JobSpec(config="/c/cfg.yaml", overrides=[], run_dir=str(run_dir), nodes=2, gpus_per_node=1, cpu=True,
                   python=str(bin_dir / "python"), workdir=str(tmp_path))
    script = tmp_path / "job.sbatch"
    script.write_text(render(spec, submitted="T"))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls), "SLURM_JOB_ID": "1234", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "node[1-2]"}
    for rc in (77, 76):
        calls.write_text("")
        out = subprocess.run(["bash", str(script)], env={**env, "SRUN_RC": str(rc)}, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == rc, out.stdout + out.stderr
        done = calls.read_text().splitlines()
        if rc == 77:
            assert "sbatch --parsable --exclude=node2,node5 --dependency=afterany:1234 /runs/x/slurm/job-1.sbatch" \
                in done, done
            assert "resubmitted as job 4321 without them" in out.stdout and not any("requeue" in c for c in done)
        else:
            assert "scontrol requeue 1234" in done and not any(c.startswith("sbatch") for c in done), done


# ----------------------------------------------------------------------------------- re-check, one process
@pytest.fixture(scope="module")
def rechecked(tiny_shards, tmp_path_factory):
    """{name: run_dir}: fault-free and ``nan@5:once`` on both engines (with dropout, so the recomputation must
    restore the RNG to match); ``nan@5`` with and without the re-check."""
    root = tmp_path_factory.mktemp("recheck")
    runs = {}
    for engine in ("deepspeed", "torch"):
        for name, inject in (("free", None), ("once", "nan@5:once")):
            runs[f"{engine}-{name}"] = root / f"{engine}-{name}"
            _train(tiny_shards, runs[f"{engine}-{name}"], f"train.engine={engine}", "model.dropout=0.1", inject=inject)
    for name, flag in (("repeated", "true"), ("unchecked", "false")):
        runs[name] = root / name
        _train(tiny_shards, runs[name], "guard.on_nonfinite=skip", f"guard.recheck={flag}", inject="nan@5")
    return runs


@pytest.mark.parametrize("engine", ["deepspeed", "torch"])
def test_a_transient_nan_is_computed_again_and_trained_as_if_nothing_happened(rechecked, engine, tmp_path):
    free, once = rechecked[f"{engine}-free"], rechecked[f"{engine}-once"]
    assert _losses(once) == _losses(free) and sorted(_losses(once)) == list(range(1, 9))  # every step trained
    assert not any(r.get("skipped") or "bad_step" in r for r in _records(once))
    _same_state(_state(free / "checkpoints" / TAG8, tmp_path), _state(once / "checkpoints" / TAG8, tmp_path))
    (rec,) = _faults(once)
    assert (rec["step"], rec["kind"], rec["recheck"], rec["action"], rec["ranks"]) == (5, "nonfinite", "transient",
                                                                                      "recomputed", [0])
    assert rec["recomputed"]["loss"] == _losses(free)[5]
    assert [r["transient_fault"]["step"] for r in _records(once) if "transient_fault" in r] == [5]


def test_a_nan_that_repeats_is_skipped_exactly_as_without_the_recheck(rechecked, tmp_path):
    checked, unchecked = rechecked["repeated"], rechecked["unchecked"]
    assert _losses(checked).keys() == _losses(unchecked).keys()
    assert all(a == b or a != a and b != b for a, b in zip(_losses(checked).values(), _losses(unchecked).values()))
    assert [r["step"] for r in _records(checked) if r.get("skipped")] == [5]
    _same_state(_state(checked / "checkpoints" / TAG8, tmp_path), _state(unchecked / "checkpoints" / TAG8, tmp_path))
    (rec,) = _faults(checked)
    assert (rec["step"], rec["action"], rec["recheck"], rec["first"]["kind"]) == (5, "skip", "repeated", "nonfinite")
    assert "recheck" not in _faults(unchecked)[0]


# ----------------------------------------------------------------------------------- evidence, one process
def test_a_crash_before_the_first_save_keeps_the_metrics_and_a_rerun_sets_them_aside(tiny_shards, tmp_path):
    from megafixed.engine import NonFiniteLossError
    from megafixed.errors import report

    run = tmp_path / "run"
    with pytest.raises(NonFiniteLossError) as err:  # nan@5 repeats: guard.on_nonfinite=stop (the default) stops
        _train(tiny_shards, run, "checkpoint.interval=100", inject="nan@5")
    before = (run / "metrics.jsonl").read_bytes()
    assert sorted(_losses(run)) == [1, 2, 3, 4] and not (run / "checkpoints").exists()
    assert report(err.value, file=open(os.devnull, "w")) == exit_codes.FAILED
    assert any(f"kept in {run}" in note and "metrics.jsonl" in note for note in err.value.__notes__)
    lines: list[str] = []
    result = _train(tiny_shards, run, "checkpoint.interval=100", lines=lines)  # fresh: nothing to resume from
    aside = run / "attempts" / "1"
    assert result.resumed_from is None and (aside / "metrics.jsonl").read_bytes() == before
    assert (aside / "faults" / "bad_steps.jsonl").exists() and (aside / "config.yaml").exists()
    assert sum("set aside" in ln and str(aside) in ln for ln in lines) == 1
    first = {r["step"]: r["loss"] for r in map(json.loads, before.decode().splitlines()) if "loss" in r}
    assert sorted(_losses(run)) == list(range(1, 9))  # its own records only, from step 1
    assert all(_losses(run)[s] == first[s] for s in first)  # steps 1-4 again, from scratch: the same bits


# ----------------------------------------------------------------------------------- a damaged checkpoint
def test_a_resume_passes_over_a_damaged_checkpoint_and_keeps_it_aside(rechecked, tiny_shards, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(rechecked["deepspeed-free"], run)
    victim = _model_file(run / "checkpoints" / TAG8)
    _flip(victim)
    lines: list[str] = []
    result = _train(tiny_shards, run, "model.dropout=0.1", lines=lines)  # the same command again (a restart)
    assert result.resumed_from == TAG4 and result.step == 8
    said = [ln for ln in lines if "damaged" in ln]
    assert len(said) == 1 and str(victim) in said[0] and "sha256 differs" in said[0], said
    assert f"Loading {run / 'checkpoints' / TAG4} instead, the newest that verifies" in said[0]
    aside = run / "checkpoints" / f"{TAG8}.damaged-corrupt"
    assert (aside / victim.name).read_bytes() != (rechecked["deepspeed-free"] / "checkpoints" / TAG8 /
                                                  victim.name).read_bytes()  # kept, with its damage
    (entry,) = json.loads((run / "checkpoints" / TAG8 / "run.json").read_text())["fallbacks"]  # the new step 8
    assert (entry["tag"], entry["why"], entry["moved_to"], entry["loaded"], entry["when"]) == (
        TAG8, "corrupt", aside.name, TAG4, "resume")
    assert _faults(run, "damaged_checkpoints.jsonl")[0]["moved_to"] == aside.name
    free = _losses(rechecked["deepspeed-free"])
    assert all(_losses(run)[s] == free[s] for s in range(1, 9))  # steps 5-8 again, from step 4: the same bits


def test_every_checkpoint_damaged_is_one_line_exit_2_and_nothing_moves(rechecked, tiny_shards, tmp_path):
    from megafixed.errors import describe
    from megafixed.run.checkpoint_error import CheckpointError

    run = tmp_path / "run"
    shutil.copytree(rechecked["deepspeed-free"], run)
    _flip(_model_file(run / "checkpoints" / TAG8))
    with pytest.raises(CheckpointError, match="is damaged") as strict:  # the strict key: the first one stops it
        _train(tiny_shards, run, "model.dropout=0.1", "checkpoint.fallback=false")
    assert describe(strict.value)[0] == exit_codes.BAD_INPUT and "no checkpoint" not in str(strict.value)
    _flip(_model_file(run / "checkpoints" / TAG4))
    listing = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(CheckpointError) as err:
        _train(tiny_shards, run, "model.dropout=0.1")
    code, line = describe(err.value)
    assert code == exit_codes.BAD_INPUT == 2 and "\n" not in line
    assert line.startswith(f"no checkpoint of {run} verifies: checkpoint {run / 'checkpoints' / TAG8} is damaged")
    assert f"checkpoint {run / 'checkpoints' / TAG4} is damaged" in line and "Nothing was moved" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == listing
    assert (run / "checkpoints" / "latest").read_text().strip() == TAG8


def test_a_rollback_passes_over_a_damaged_checkpoint(tiny_shards, tmp_path, monkeypatch):
    """The rollback's checkpoint (step 6) is damaged right after its commit (a deterministic point); the spike at
    step 7 rolls back past it to step 4, and the run equals a fresh one that skips steps 5-7."""
    import megafixed.train.checkpoint as checkpoint

    commit = checkpoint.commit

    def commit_then_damage(ckpt_dir, tag, *args, **kwargs):
        commit(ckpt_dir, tag, *args, **kwargs)
        if tag == "step_00000006":
            _flip(_model_file(Path(ckpt_dir) / tag))
    monkeypatch.setattr(checkpoint, "commit", commit_then_damage)
    rolled, fresh = tmp_path / "rolled", tmp_path / "fresh"
    roll = ("train.max_steps=9", "checkpoint.interval=2", "guard.spike_window=4", "guard.rollback_skip=0",
            "guard.on_spike=rollback")
    lines: list[str] = []
    _train(tiny_shards, rolled, *roll, inject="spike@7:factor=1000", lines=lines)  # it repeats: rolled back
    said = [ln for ln in lines if "damaged" in ln]
    assert len(said) == 1 and "step_00000006" in said[0] and "step_00000004 instead" in said[0], lines
    (bad,) = [ln for ln in lines if ln.startswith("bad step 7:")]  # it points at the file it was written to
    assert bad.endswith(f"recorded in {rolled / 'faults' / 'bad_steps.jsonl'}") and _faults(rolled)[0]["step"] == 7
    assert "again, computed a second time from the same state (not transient); action rollback" in bad
    assert (rolled / "checkpoints" / "step_00000006.damaged-corrupt").is_dir()
    window = json.loads((rolled / "faults" / "skipped_steps.json").read_text())["windows"]
    assert [(w["first"], w["last"]) for w in window] == [(5, 7)]  # from the checkpoint it could load
    monkeypatch.setattr(checkpoint, "commit", commit)
    _train(tiny_shards, fresh, *roll, "data.skip_steps=5-7")
    a, b = _losses(rolled), _losses(fresh)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 8, 9] and all(a[s] == b[s] for s in a)
    record = json.loads((rolled / "checkpoints" / "step_00000009" / "run.json").read_text())
    assert [(f["tag"], f["loaded"], f["when"]) for f in record["fallbacks"]] == [("step_00000006", TAG4, "rollback")]


# ----------------------------------------------------------------------------------- two ranks
DP2 = ("train.max_steps=8", "checkpoint.interval=2", "validation.interval=0", "checkpoint.keep=0",
       "guard.spike_window=4", "guard.on_spike=skip")


def _torchrun(run_dir, shards, *extra, inject, timeout=400):
    args = ["-m", "megafixed.cli", "train", "/dev/null",
            *tiny_overrides(shards, run_dir, *DP2, *extra, f"faults.inject={inject}")]
    return _launch(2, args, {}, timeout=timeout)


@pytest.fixture(scope="module")
def dp2_transient(tiny_shards, tmp_path_factory):
    """DP2: a transient spike on rank 1 at step 5 (one allowed per node): the run saves and exits 77. Then the
    requeue: its newest checkpoint (5) damaged, and rank 1 hung before the first step after the resume."""
    run = tmp_path_factory.mktemp("dp2_transient") / "run"
    first = _torchrun(run, tiny_shards, "guard.max_transient_faults=1", inject="spike@5:once:rank=1")
    saved = (run / "checkpoints" / "latest").read_text().strip()
    victim = _model_file(run / "checkpoints" / saved)
    _flip(victim)
    second = _torchrun(run, tiny_shards, "watchdog.timeout_s=20", "parallel.collective_timeout_s=40",
                       inject="hang@5:rank=1")
    return run, first, saved, victim, second


@pytest.mark.multiprocess
def test_dp2_a_transient_spike_names_rank_1_and_leaves_its_node(dp2_transient):
    run, (code, text, _, _), saved, _, _ = dp2_transient
    host = socket.gethostname()
    assert code == exit_codes.EXCLUDE_NODE or f"exitcode  : {exit_codes.EXCLUDE_NODE}" in text, text[-3000:]
    assert "transient fault at step 5: the loss" in text and f"rank 1 on {host}" in text, text[-3000:]
    (rec,) = _faults(run)
    assert (rec["step"], rec["kind"], rec["recheck"], rec["ranks"], rec["nodes"]) == (5, "spike", "transient", [1],
                                                                                     [host])
    assert (run / "faults" / "exclude_nodes.txt").read_text() == f"{host}\n"
    assert saved == "step_00000005" and f"leaving node {host}" in text and "Exit 77" in text
    assert not any(r.get("skipped") for r in _records(run) if r["step"] <= 5)


@pytest.mark.multiprocess
def test_a_requeue_falls_back_and_a_hang_on_its_first_step_is_named_before_gloo(dp2_transient):
    run, _, saved, victim, (code, text, _, _) = dp2_transient
    assert f"exitcode  : {exit_codes.HUNG}" in text, text[-4000:]
    assert str(victim) in text and "step_00000004 instead, the newest that verifies" in text, text[-4000:]
    assert (run / "checkpoints" / f"{saved}.damaged-corrupt").is_dir()
    assert "resumed from" in text and "(step 4," in text
    assert f"rank 1 on {socket.gethostname()} never reached step 5" in text, text[-4000:]  # named: gloo came later
    stacks = sorted((run / "faults").glob("hang.step00000005.rank*.txt"))
    assert [p.name.split(".")[2] for p in stacks] == ["rank00000", "rank00001"]


@pytest.mark.multiprocess
def test_a_hang_before_the_first_checkpoint_keeps_its_stacks_and_metrics(tiny_shards, tmp_path):
    run = tmp_path / "run"
    code, text, _, _ = _torchrun(run, tiny_shards, "checkpoint.interval=100", "watchdog.timeout_s=10",
                                 "metrics.tensorboard=true", inject="hang@2:rank=1")
    assert f"exitcode  : {exit_codes.HUNG}" in text, text[-3000:]
    stacks = sorted((run / "faults").glob("hang.step00000002.rank*.txt"))
    assert [p.name.split(".")[2] for p in stacks] == ["rank00000", "rank00001"]
    assert f"Python stacks of every rank in {run / 'faults'}/hang.step00000002.rank*.txt" in text
    assert [r["step"] for r in _records(run) if "loss" in r] == [1] and (run / "config.yaml").exists()
    # TensorBoard too: the hang leaves by os._exit, which flushes nothing, so each record is flushed as written
    assert [s for s, _ in raw_scalars(run / "tensorboard")["train/loss"]] == [1]
    assert not (run / "checkpoints").exists()


@pytest.mark.multiprocess
def test_drills_that_cannot_fire_are_refused_on_two_ranks(tiny_shards, tmp_path):
    run = tmp_path / "run"
    code, text, _, _ = _torchrun(run, tiny_shards, inject="nan@3:rank=5;nan@99")
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert f"exitcode  : {exit_codes.BAD_INPUT}" in text and len(errors) == 1, text[-3000:]
    assert "'nan@3:rank=5' cannot fire: rank 5 is not below the world size 2" in errors[0]
    assert "'nan@99' cannot fire: step 99 is beyond train.max_steps=8" in errors[0]
    assert not run.exists()
