"""Documented commands a new user runs first, and what they print when something is missing.

Each test here failed on the main branch of 2026-12-01 (issue 24); the docs test
(tests/test_readme_commands.py) runs the README's commands themselves."""
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
    from megafixed.parallel.topology import Topology
    from megafixed.train.resume import ResumeError, check_resume, run_record

    topo = Topology(world_size=1, rank=0, local_rank=0, tp=1, pp=1, dp=1)
    saved = run_record(load_config(None, ["model.input=canonical"]), topo, "fp32", 1)
    tag = tmp_path / "checkpoints" / "step_00000300"
    with pytest.raises(ResumeError) as refused:
        check_resume(saved, load_config(None, ["model.input=gf2", "model.code_seed=7"]), topo, "fp32", 1, tag)
    message = str(refused.value)
    assert message.startswith(f"cannot resume {tmp_path}: model.input changed from 'canonical' to 'gf2'")
    assert "model.code_rows" in message  # still listed, after the key the user set


def test_the_readme_gf2_example_has_a_run_dir_of_its_own():
    readme = (ROOT / "README.md").read_text()
    line = readme[readme.index("examples/configs/quickstart.yaml model.input=gf2"):].split("#")[0]
    assert "train.run_dir=" in line and "train.run_dir=runs/quickstart " not in line + " "


# ------------------------------------------------------------------- output that reads as written by a person
def test_counts_of_one_are_singular():
    from megafixed.data.preprocess import PreprocessReport

    line = PreprocessReport(outputs={"text": ["o"]}, documents=1, tokens=1, workers=1, seconds=1.0).summary()
    assert "wrote 1 document, 1 token" in line and "1 worker)" in line
    line = PreprocessReport(outputs={"text": ["o"]}, documents=2, tokens=1500, workers=3, seconds=1.0).summary()
    assert "wrote 2 documents, 1,500 tokens" in line and "3 workers)" in line


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
