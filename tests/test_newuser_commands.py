"""Documented commands a new user runs first, and what they print when something is missing.

Each test here checks a first-run path a new user meets; the docs test
(tests/test_readme_commands.py) runs the commands of the README and its docs pages themselves."""
from __future__ import annotations

from pathlib import Path

import pytest

from megafixed.cli import main
from megafixed.config import load_config

ROOT = Path(__file__).resolve().parent.parent
PAPER_GF2 = str(ROOT / "examples" / "configs" / "paper-1.7b-gf2.yaml")


# ------------------------------------------------------------------- planning a GPU run where the data is not
def test_a_dry_run_plans_without_the_shards_and_names_data_mock(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the config's data/corpus/... shards do not exist here
    assert main(["train", PAPER_GF2, "--dry-run", "--world-size", "64", "parallel.tp=2"]) == 0
    captured = capsys.readouterr()
    assert "# plan: 64 ranks = tp 2 x pp 1 x dp 32" in captured.out
    warning = [ln for ln in captured.err.splitlines() if ln.startswith("warning:")]
    assert len(warning) == 1 and "no shards for data prefix" in warning[0] and "data.mock=true" in warning[0]
    # context parallelism: the plan line names it after tp, and a line says how each sequence is split
    assert main(["train", PAPER_GF2, "--dry-run", "--world-size", "64", "parallel.tp=2", "parallel.cp=4"]) == 0
    out = capsys.readouterr().out
    assert "# plan: 64 ranks = tp 2 x cp 4 x pp 1 x dp 8" in out
    assert ("# context parallel: cp 4 (ulysses), each sequence of 2048 tokens split into 4 slices of 512 "
            "(Ulysses: ") in out and "gradients reduced over dp x cp = 32 ranks" in out
    assert "# context parallel" not in captured.out  # none at cp 1
    # submit --dry-run says the same thing in the same words
    assert main(["submit", PAPER_GF2, "--nodes", "4", "--gpus-per-node", "8", "--dry-run"]) == 0
    assert warning[0].split(" (a dry run")[0] in capsys.readouterr().err


def test_a_real_run_without_shards_names_data_mock_in_its_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    from megafixed.commands.train import _check_data_paths
    from megafixed.data.errors import DataError

    with pytest.raises(DataError, match=r"no shards for data prefix .*data\.mock=true"):
        _check_data_paths(load_config(PAPER_GF2, []))
    with pytest.raises(DataError, match=r"no data: .*data\.mock=true"):
        _check_data_paths(load_config(None, ["data.prefixes=[]"]))


# ------------------------------------------------------------------- a refused resume names what the user typed
def test_a_refused_resume_leads_with_the_key_typed_not_the_derived_code_rows(tmp_path):
    from megafixed.run_plan import RunPlan
    from megafixed.train.resume import ResumeError, check_resume, run_record

    plan = RunPlan.build(load_config(None, ["model.input=canonical"]), 1, gpu=False)
    saved = run_record(load_config(None, ["model.input=canonical"]), plan)
    tag = tmp_path / "checkpoints" / "step_00000300"
    with pytest.raises(ResumeError) as refused:
        check_resume(saved, load_config(None, ["model.input=gf2", "model.code_seed=7"]), plan, tag)
    message = str(refused.value)
    assert message.startswith(f"cannot resume {tmp_path}: model.input changed from 'canonical' to 'gf2'")
    assert "model.code_rows" in message  # still listed, after the key the user set


def test_the_documented_gf2_example_has_a_run_dir_of_its_own():
    training = (ROOT / "docs" / "training.md").read_text()  # the configs section, moved from the README
    line = training[training.index("examples/configs/quickstart.yaml model.input=gf2"):].split("#")[0]
    assert "train.run_dir=" in line and "train.run_dir=runs/quickstart " not in line + " "


# ------------------------------------------------------------------- output that reads as written by a person
def test_counts_of_one_are_singular():
    from megafixed.data.preprocess import PreprocessReport

    line = PreprocessReport(outputs={"text": ["o"]}, documents=1, tokens=1, workers=1, seconds=1.0).summary()
    assert "wrote 1 document, 1 token" in line and "1 worker)" in line
    line = PreprocessReport(outputs={"text": ["o"]}, documents=2, tokens=1500, workers=3, seconds=1.0).summary()
    assert "wrote 2 documents, 1,500 tokens" in line and "3 workers)" in line
    from megafixed.plural import count

    assert [count(1, "rank"), count(0, "step"), count(2, "node")] == ["1 rank", "0 steps", "2 nodes"]


def test_a_one_rank_plan_says_1_rank(capsys):
    assert main(["train", str(ROOT / "examples" / "configs" / "quickstart.yaml"), "--dry-run", "--world-size",
                 "1", "--target", "cpu"]) == 0
    assert "# plan: 1 rank = tp 1 x pp 1 x dp 1" in capsys.readouterr().out


def test_a_batch_that_does_not_divide_gets_each_suggestion_once():
    from megafixed.parallel.layout import LayoutError, batch_layout

    cfg = load_config(None, ["train.global_batch=32", "train.micro_batch=16"])
    with pytest.raises(LayoutError) as refused:
        batch_layout(cfg.train, dp=32)
    assert "(e.g. train.global_batch=512)" in str(refused.value)
    with pytest.raises(LayoutError, match=r"e\.g\. train\.global_batch=8 or 16\)"):
        batch_layout(load_config(None, ["train.global_batch=12", "train.micro_batch=8"]).train, dp=1)


def test_data_inspect_prints_the_mean_length_to_one_decimal(tmp_path, capsys):
    import re

    from _train_data import write_shards

    prefix = write_shards(tmp_path, docs=7)
    assert main(["data", "inspect", prefix]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "tokens_per_doc" in ln)
    assert re.fullmatch(r"\s*tokens_per_doc: mean [\d,]+\.\d, min \d+, max \d+", line), line


# ------------------------------------------------------------------- plots: optional, said up front
def test_probe_plot_without_matplotlib_fails_before_any_work(tmp_path, monkeypatch, capsys):
    import megafixed.plotting
    import megafixed.study.probe

    monkeypatch.setattr(megafixed.plotting, "have_matplotlib", lambda: False)
    monkeypatch.setattr(megafixed.study.probe, "probe_run", lambda *a, **k: pytest.fail("probed before refusing"))
    assert main(["probe", str(tmp_path / "no-run"), "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--plot" in err[0] and "matplotlib" in err[0] and "megafixed[plot]" in err[0]


def _fake_results():
    return [{"interface": i, "seed": s, "point": "base", "checkpoint": "step_00000004", "steps": 4,
             "trainable_params": 10, "input_params": 0, "final_val_loss": 5.0 + s, "test_loss": 5.0, "test_bpb": 1.0,
             "val_curve": [[2, 6.0], [4, 5.0]], "tasks": {}} for i in ("learned", "canonical") for s in (0, 1)]


def test_a_study_without_matplotlib_says_it_skips_the_pngs(tmp_path, monkeypatch, capsys):
    import megafixed.plotting
    import megafixed.study.runner

    monkeypatch.setattr(megafixed.plotting, "have_matplotlib", lambda: False)
    monkeypatch.setattr(megafixed.study.runner, "run_study", lambda *a, **k: _fake_results())
    out = tmp_path / "study"
    assert main(["study", "--interfaces", "learned,canonical", "--seeds", "0,1", "--eval-tasks", "",
                 "--out", str(out), str(ROOT / "examples" / "configs" / "quickstart.yaml")]) == 0
    said = capsys.readouterr().out
    assert "matplotlib is not installed" in said and "no PNG" in said and "megafixed[plot]" in said
    report = (out / "report.md").read_text()
    assert "None: matplotlib is not installed" in report and not list(out.glob("*.png"))


def test_a_study_without_a_grid_puts_its_runs_in_out_itself(tmp_path, capsys):
    from megafixed.study.plan import plan_runs

    runs = plan_runs(tmp_path, ["learned", "gf2"], [0], [])
    assert [r.run_dir for r in runs] == [tmp_path / "learned-s0", tmp_path / "gf2-s0"]
    gridded = plan_runs(tmp_path, ["gf2"], [0], [("model.n_layers", ["2", "4"])])
    assert gridded[1].run_dir == tmp_path / "model.n_layers=4" / "gf2-s0"  # the probe path in docs/study.md
    (tmp_path / "base").mkdir()  # a study begun with the old layout keeps it (its runs are not retrained)
    assert plan_runs(tmp_path, ["gf2"], [0], [])[0].run_dir == tmp_path / "base" / "gf2-s0"


# ------------------------------------------------------------------- the probe's baseline is the majority class
def test_the_probe_baseline_is_each_bits_majority_share():
    import torch

    from megafixed.study.probe import majority_baseline

    gen = torch.Generator().manual_seed(0)
    n = 4000
    skewed = torch.where(torch.rand(n, generator=gen) < 0.7, 1.0, -1.0)  # 70 % of positions +1
    rare = torch.where(torch.rand(n, generator=gen) < 0.1, 1.0, -1.0)  # 10 % +1
    fair = torch.where(torch.rand(n, generator=gen) < 0.5, 1.0, -1.0)
    base = majority_baseline(torch.stack([skewed, rare, fair], 1))
    held = slice(int(n * 0.75), None)
    assert base[0] == pytest.approx(float((skewed[held] > 0).double().mean()))
    assert base[1] == pytest.approx(float((rare[held] < 0).double().mean()))
    assert base[0] == pytest.approx(0.7, abs=0.04) and base[1] == pytest.approx(0.9, abs=0.03)
    assert base[2] == pytest.approx(0.5, abs=0.05)


# ------------------------------------------------------------------- submit --chain --dry-run shows the chain
def test_submit_chain_dry_run_lists_every_job_and_turns_requeue_off(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base = ["submit", PAPER_GF2, "--nodes", "4", "--gpus-per-node", "8", "--dry-run", "data.mock=true"]
    assert main(base) == 0
    single = capsys.readouterr()
    assert "REQUEUE=${MEGAFIXED_REQUEUE:-1}" in single.out and "--chain" not in single.err
    assert main([*base, "--chain", "3"]) == 0
    chained = capsys.readouterr()
    assert chained.out.startswith("#!/bin/bash") and "REQUEUE=${MEGAFIXED_REQUEUE:-0}" in chained.out
    jobs = [ln for ln in chained.err.splitlines() if ln.startswith("#   job ")]
    assert len(jobs) == 3 and "--dependency" not in jobs[0]
    assert "--dependency=afterany:<job 1>" in jobs[1] and "--dependency=afterany:<job 2>" in jobs[2]
    assert all(ln.endswith("/slurm/job-<time>.sbatch") for ln in jobs) and "requeue is off" in chained.err
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
