"""``megafixed study`` end to end on a tiny grid, its resume, and ``megafixed probe``."""
from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest
import yaml

from _metrics import read_metrics
from _train_data import tiny_overrides, write_shards
from megafixed.cli import main


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """2 interfaces x 2 seeds, 4 steps each, through the real CLI."""
    tmp = tmp_path_factory.mktemp("study")
    prefix = write_shards(tmp / "data")
    overrides = tiny_overrides(prefix, tmp / "unused", "train.max_steps=4", "validation.interval=2",
                               "checkpoint.interval=4")
    config = tmp / "tiny.yaml"
    config.write_text(yaml.safe_dump({}))
    args = ["study", str(config), *[o for o in overrides if not o.startswith("train.run_dir")],
            "--interfaces", "learned,canonical", "--seeds", "0,1", "--out", str(tmp / "out")]
    assert main(args) == 0
    return tmp / "out", args


def _final_val(run_dir: Path) -> float:
    return read_metrics(run_dir, "val_loss")[-1]["val_loss"]


def test_the_report_tabulates_the_runs_own_metrics(study):
    out, _ = study
    report = (out / "report.md").read_text()
    for interface in ("learned", "canonical"):
        vals = [_final_val(out / f"{interface}-s{seed}") for seed in (0, 1)]
        row = next(line for line in report.splitlines() if line.startswith(f"| base | {interface} | 4 |"))
        mean, std = (float(v) for v in re.search(r"\| ([\d.]+) ± ([\d.]+) \|", row).groups())
        assert mean == pytest.approx(statistics.fmean(vals), abs=1e-4)
        assert std == pytest.approx(statistics.stdev(vals), abs=1e-4)
    # paired difference canonical - learned, per seed
    diffs = [_final_val(out / f"canonical-s{s}") - _final_val(out / f"learned-s{s}") for s in (0, 1)]
    row = next(line for line in report.splitlines() if line.startswith("| base | canonical | ") and "Δ" not in line
               and line.count("|") == 6)
    assert float(re.search(r"\| (-?[\d.]+) ± ", row).group(1)) == pytest.approx(statistics.fmean(diffs), abs=1e-4)
    assert "| base | canonical | " in report and "trainable" in report
    assert (out / "val_loss_base.png").stat().st_size > 1000
    evals = json.loads((out / "canonical-s0" / "study_eval.json").read_text())
    assert evals["input_params"] == 0 and math.isfinite(evals["test_loss"]) and evals["test_tokens"] > 0
    assert math.isnan(evals["test_bpb"])  # synthetic shards have no tokenizer: no bytes to count


def test_rerunning_skips_finished_runs(study, capsys):
    out, args = study
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/metrics.jsonl")}
    assert len(stamps) == 4
    assert main(args) == 0
    said = capsys.readouterr().out
    assert said.count("finished earlier, skipped") == 4 and "training" not in said
    assert stamps == {p: p.stat().st_mtime_ns for p in out.glob("*/metrics.jsonl")}


def test_a_study_dir_of_another_config_is_refused(study, capsys):
    out, args = study
    assert main([*args, "model.n_layers=3"]) == 2
    assert "holds a study of another config" in capsys.readouterr().err


@pytest.fixture(scope="module")
def trained_canonical(tmp_path_factory):
    from megafixed.config import load_config
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.trainer import train

    tmp = tmp_path_factory.mktemp("probe")
    prefix = write_shards(tmp / "data")
    cfg = load_config(None, tiny_overrides(prefix, tmp / "run", "model.input=canonical", "train.max_steps=30",
                                           "validation.interval=0", "optimizer.lr=1e-2"))
    train(cfg, setup_distributed(RunPlan.for_launch(cfg)), log=lambda *_: None)
    return tmp / "run"


def test_probe_recovers_the_code_at_the_input_and_not_the_previous_token(trained_canonical, tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert main(["probe", str(trained_canonical), "--tokens", "2048", "--json", str(out),
                 "--plot", str(tmp_path / "probe.png")]) == 0
    res = json.loads(out.read_text())[0]
    # beside each accuracy, the majority-class baseline of its targets (not a fixed 0.5)
    said = capsys.readouterr().out
    assert "baseline" in said and "chance 0.50" not in said
    assert len(res["own_baseline_bits"]) == 8 and res["own_baseline"] == pytest.approx(
        sum(res["own_baseline_bits"]) / 8) and f"{res['own_baseline']:8.3f}" in said
    assert res["interface"] == "canonical" and res["layers"] == [0, 1, 2]
    assert res["own"][0] >= 0.99  # layer 0 is the code itself: every bit linearly readable
    assert (tmp_path / "probe.png").stat().st_size > 1000
    # On uniformly random tokens (no stride rule linking neighbours) layer 0 says nothing about the
    # previous token, and the trained attention brings it in.
    import torch

    from megafixed.study.probe import probe_model
    from megafixed.train.evaluate import load_trained_model

    model, _ = load_trained_model(None, trained_canonical)
    windows = torch.randint(0, 256, (64, 32), generator=torch.Generator().manual_seed(0))
    _, own, prev, own_base, _ = probe_model(model, windows)
    assert own[0] >= 0.99 and 0.4 <= prev[0] <= 0.6
    assert len(own_base) == 8 and all(0.4 <= b <= 0.6 for b in own_base)  # uniform ids: every bit near 50/50
    assert max(prev[1:]) > prev[0] + 0.05, prev  # measured 0.585 vs 0.514 (deterministic on CPU)


def test_submit_renders_one_slurm_job_per_unfinished_run(study, tmp_path, capsys):
    out, args = study
    other = [a if a != str(out) else str(tmp_path / "new") for a in args]  # a fresh study dir: nothing finished
    assert main([*other, "--submit", "--submit-args", "--gpus-per-node 1 --cpu --dry-run"]) == 0
    said = capsys.readouterr().out
    scripts = said.count("#!/bin/bash")
    assert scripts == 4 and said.count("model.input=canonical") >= 2 and "train.seed=1" in said
    assert "rerun this command without --submit" in said
    assert main([*args, "--submit", "--submit-args", "--gpus-per-node 1 --cpu --dry-run"]) == 0
    assert capsys.readouterr().out.count("finished earlier, not submitted") == 4
