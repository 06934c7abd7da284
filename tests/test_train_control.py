"""The trainer's controls: the stop request, the resume check, ``--dry-run`` and clean failures."""
from __future__ import annotations

import hashlib
import json
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from _env import signal_after_logged_steps
from _metrics import read_metrics
from _train_data import tiny_overrides, write_shards
from megafixed.config import load_config
from megafixed.train.stop import StopRequest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("shards"))


class StopAfterPolls(StopRequest):
    """Requests a stop at the n-th poll, as a signal arriving at that moment would."""

    def __init__(self, polls: int):
        super().__init__()
        self.left = polls

    def should_stop(self, group=None):
        self.left -= 1
        if self.left == 0:
            self.request("test stop")
        return super().should_stop(group)


def run(prefix, run_dir, *extra, stop=None):
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.trainer import train

    cfg = load_config(None, tiny_overrides(prefix, run_dir, *extra))
    return train(cfg, setup_distributed(RunPlan.for_launch(cfg)), stop=stop, log=lambda *_: None)


def losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "loss")}


def tree_hash(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------------- stop request
def test_a_stop_request_saves_at_the_step_and_the_rerun_continues_identically(shards, tmp_path):
    common = ("train.max_steps=6", "validation.interval=0", "checkpoint.interval=100", "model.input=gf2")
    straight = run(shards, tmp_path / "straight", *common)
    stopped = run(shards, tmp_path / "stopped", *common, stop=StopAfterPolls(3))
    assert stopped.stopped and stopped.step == 3 and stopped.checkpoint == "step_00000003"
    assert (tmp_path / "stopped" / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    resumed = run(shards, tmp_path / "stopped", *common)
    assert resumed.resumed_from == "step_00000003" and resumed.step == 6 and not resumed.stopped
    assert losses(tmp_path / "stopped") == losses(tmp_path / "straight")  # bit-identical, CPU fp32
    assert straight.step == 6
    ds = json.loads((tmp_path / "stopped" / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 8 and "data_types" not in ds  # fp32 run: nothing to accumulate in 16 bit


def test_a_stop_during_validation_cuts_the_pass_short_and_saves(shards, tmp_path):
    # polls: step-0 validation (2 batches), end of step 1, step-2 validation's first batch -> stop
    result = run(shards, tmp_path, "train.max_steps=10", "validation.interval=2", "validation.iters=2",
                 "checkpoint.interval=100", stop=StopAfterPolls(4))
    assert result.stopped and result.step == 2 and result.checkpoint == "step_00000002"
    recs = read_metrics(tmp_path)
    assert "val_loss" in recs[0] and not any("val_loss" in r for r in recs if r["step"] == 2)


def test_sigusr1_stops_the_cli_with_exit_75_and_the_same_command_resumes(shards, tmp_path):
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    cmd = [sys.executable, "-m", "megafixed.cli", "train", str(cfg),
           *tiny_overrides(shards, tmp_path / "run", "train.max_steps=400", "validation.interval=0",
                           "checkpoint.interval=1000")]
    proc = signal_after_logged_steps(cmd, ROOT, tmp_path / "run" / "metrics.jsonl", signal.SIGUSR1)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 75, err[-3000:]
    tag = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    step = int(tag.split("_")[1])
    assert 3 <= step < 400 and f"stopped: {step} steps" in out
    assert "Run the same command again to resume" in out


# ----------------------------------------------------------------------------------- resume check
@pytest.mark.parametrize("change", ["model.n_heads=2", "model.rope_theta=500.0", "model.max_seq_len=64",
                                    "data.seq_len=16"])
def test_a_changed_model_or_data_key_is_refused_before_anything_is_touched(shards, tmp_path, change):
    from megafixed.train.checkpoint import CheckpointError

    run(shards, tmp_path, "train.max_steps=4", "checkpoint.interval=2", "checkpoint.keep=1",
        "validation.interval=0")
    before = tree_hash(tmp_path)
    key = change.split("=")[0]
    with pytest.raises(CheckpointError, match=rf"cannot resume .*: {key.replace('.', '[.]')} changed from .* "
                                              rf"since checkpoint step_00000004.*config\.yaml"):
        run(shards, tmp_path, "train.max_steps=8", "checkpoint.interval=2", "checkpoint.keep=1",
            "validation.interval=0", change)
    assert tree_hash(tmp_path) == before  # config.yaml, latest, the checkpoint list, metrics: untouched


def test_safe_changes_are_allowed_and_reported(shards, tmp_path):
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.trainer import train

    run(shards, tmp_path, "train.max_steps=3", "validation.interval=0")
    cfg = load_config(None, tiny_overrides(shards, tmp_path, "train.max_steps=5", "validation.interval=0",
                                           "optimizer.lr=1e-3"))
    said = []
    result = train(cfg, setup_distributed(RunPlan.for_launch(cfg)), log=said.append)
    assert result.resumed_from == "step_00000003" and result.step == 5
    line = next(s for s in said if s.startswith("resumed from"))
    assert "optimizer.lr: 0.003 -> 0.001" in line and "train.max_steps: 3 -> 5" in line
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["max_steps"] == 5


def test_a_layout_change_universal_checkpoints_cannot_cover_is_refused_naming_why(tmp_path):
    # ZeRO-1/2 layout changes resume through a universal checkpoint (tests/test_ckpt_universal.py);
    # ZeRO-0 keeps torch's optimizer state in the model files, which DeepSpeed's converter does not read.
    from megafixed.train.resume import ResumeError, check_resume, run_record

    def plan(tp, dp, zero):  # the layout a RunPlan gives the resume check (tp, pp, dp, zero_stage, precision)
        return SimpleNamespace(tp=tp, pp=1, dp=dp, engine_plan=SimpleNamespace(zero_stage=zero), precision="fp32")

    cfg = load_config(None, ["parallel.tp=2", "zero.stage=0"])
    saved = run_record(cfg, plan(tp=2, dp=1, zero=0))
    tag = tmp_path / "checkpoints" / "step_00000010"
    with pytest.raises(ResumeError, match=r"different layout \(parallel\.tp 2 -> 1\): zero\.stage=0 keeps the "
                                          r"optimizer state .*megafixed convert .* --tp 1 --pp 1"):
        check_resume(saved, load_config(None, ["zero.stage=0"]), plan(tp=1, dp=2, zero=0), tag)
    saved1 = run_record(load_config(None, ["parallel.tp=2"]), plan(tp=2, dp=1, zero=1))
    assert check_resume(saved1, load_config(None, []), plan(tp=1, dp=2, zero=1), tag)[-2:] == [
        "layout: parallel.tp 2 -> 1", "layout: the data-parallel size (world size / (tp*pp)) 1 -> 2"]
    # the same layout with ZeRO-0 may change DP: nothing is partitioned
    saved0 = run_record(load_config(None, ["parallel.tp=2"]), plan(tp=1, dp=1, zero=0))
    assert check_resume(saved0, load_config(None, ["parallel.tp=2"]), plan(tp=1, dp=2, zero=0), tag) == []


def test_a_context_parallel_size_is_recorded_and_another_one_resumes_as_a_safe_change(tmp_path):
    # checkpoints do not depend on cp (parameters and their names are untouched): a CP2 checkpoint resumes at
    # CP1 and the other way on either engine, the change reported; a record without cp is cp 1
    from megafixed.run_plan import RunPlan
    from megafixed.train.resume import check_resume, run_record
    from megafixed.train.trainer import _start_line

    tag = tmp_path / "checkpoints" / "step_00000010"
    for engine in ("torch", "deepspeed"):
        cfg2 = load_config(None, [f"train.engine={engine}", "parallel.cp=2"])
        cfg1 = load_config(None, [f"train.engine={engine}"])
        cp2, cp1 = RunPlan.build(cfg2, 2, gpu=False), RunPlan.build(cfg1, 1, gpu=False)
        saved2, saved1 = run_record(cfg2, cp2), run_record(cfg1, cp1)
        assert saved2["layout"]["cp"] == 2 and "cp" not in saved1["layout"]  # a cp 1 record as it was
        assert "parallel.cp: 2 -> 1" in check_resume(saved2, cfg1, cp1, tag)  # named, and allowed
        assert "parallel.cp: 1 -> 2" in check_resume(saved1, cfg2, cp2, tag)
        assert check_resume(saved2, cfg2, cp2, tag) == []
        # the start line names it beside tp; a cp 1 run's line has no cp
        assert ", tp 1, cp 2 (ulysses), pp 1, " in _start_line(cfg2, cp2)
        assert ", tp 1, pp 1, " in _start_line(cfg1, cp1)


# ----------------------------------------------------------------------------------- dry run, failures
def test_dry_run_plans_a_gpu_run_on_a_cpu_machine(shards, capsys):
    from megafixed.cli import main

    paper = str(ROOT / "examples" / "configs" / "paper-1.7b-canonical.yaml")
    data = f"data.prefixes=[{shards}]"
    assert main(["train", paper, "--dry-run", "--world-size", "64", "parallel.tp=2", "parallel.pp=2", data]) == 0
    out = capsys.readouterr().out
    resolved, ds_text = out.split("# deepspeed config")
    cfg = yaml.safe_load(resolved)
    ds = json.loads(ds_text[ds_text.index("{"):ds_text.rindex("}") + 1])
    assert cfg["model"]["input"] == "canonical" and cfg["parallel"]["tp"] == 2
    assert ds["bf16"]["enabled"] and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["train_batch_size"] == cfg["train"]["global_batch"]
    assert ds["gradient_accumulation_steps"] * ds["train_micro_batch_size_per_gpu"] * 16 == ds["train_batch_size"]
    assert "64 ranks = tp 2 x pp 2 x dp 16" in out and "backend nccl" in out and "Nothing was started" in out
    # a world size the layout does not divide: one line, exit 2
    assert main(["train", paper, "--dry-run", "--world-size", "6", "parallel.tp=4", data]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "world size 6 is not divisible by parallel.tp * parallel.pp = 4*1" in err[0]


def test_a_run_that_fails_before_its_first_checkpoint_keeps_what_it_logged_and_says_where(shards, tmp_path):
    """Evidence is never deleted (issue 43): the run's records of step 1 and the verdict on step 2 stay, and the
    error's notes (its exit line) name the directory; only a run that failed before writing anything of its own
    steps removes the directory it created (tests/test_unattended.py)."""
    import json

    from megafixed.engine import NonFiniteLossError

    cfg = load_config(None, tiny_overrides(shards, tmp_path / "run", "train.max_steps=4", "validation.interval=0",
                                           "optimizer.grad_clip=0.0", "zero.stage=0", "schedule.warmup_steps=0"))
    cfg.optimizer.lr = 1e30  # blows the weights up: step 2 is non-finite
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.trainer import train

    with pytest.raises(NonFiniteLossError) as err:
        train(cfg, setup_distributed(RunPlan.for_launch(cfg)), log=lambda *_: None)
    run = tmp_path / "run"
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r] == [1]
    assert json.loads((run / "faults" / "bad_steps.jsonl").read_text().splitlines()[0])["step"] == 2
    assert not (run / "checkpoints").exists() and any(f"kept in {run}" in n for n in err.value.__notes__)
