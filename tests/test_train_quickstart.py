"""The main job's pipeline on the bundled corpus, shrunk to a few steps: data -> train -> evaluate."""
from __future__ import annotations

import json
import math

import pytest
import torch

from megafixed.config import load_config


def test_quickstart_end_to_end_small(tmp_path, capsys):
    from megafixed.commands.quickstart import DEFAULT_CONFIG, _anchor_paths, quickstart
    from megafixed.data.gpt_dataset import build_datasets
    from megafixed.train.evaluate import load_trained_model

    cfg = load_config(str(DEFAULT_CONFIG), ["train.max_steps=4", "validation.interval=2", "checkpoint.interval=2",
                                            "model.n_layers=1", "model.d_model=64", "model.n_heads=2",
                                            f"train.run_dir={tmp_path / 'run'}", "metrics.tensorboard=false"])
    _anchor_paths(cfg)
    summary = quickstart(cfg, sample_tokens=4)
    out = capsys.readouterr().out
    assert summary["steps"] == 4 and summary["checkpoint"].endswith("step_00000004")
    assert json.loads((tmp_path / "run" / "quickstart.json").read_text())["test_loss"] == summary["test_loss"]
    assert "test loss" in out and "metrics" in out and str(tmp_path / "run" / "metrics.jsonl") in out
    assert summary["val_loss_first"] == pytest.approx(math.log(4096), abs=0.2)
    assert summary["val_loss_last"] < summary["val_loss_first"]
    assert all(isinstance(s["completion"], str) for s in summary["samples"])
    # one generation path: `megafixed generate` prints the quickstart's greedy sample for the same checkpoint
    from megafixed.cli import main

    sample = summary["samples"][0]
    assert main(["generate", str(tmp_path / "run"), "--prompt", sample["prompt"], "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out == sample["prompt"] + sample["completion"] + "\n"

    # Independent reference: the mean next-token NLL over every whole micro batch of the test split.
    from megafixed.data.prepare import prepare_data

    cfg = prepare_data(cfg, progress=False)
    test = build_datasets(cfg.data, seed=cfg.train.seed)["test"]
    model, _ = load_trained_model(cfg, tmp_path / "run")
    mb = cfg.train.micro_batch
    n = len(test) // mb * mb
    tokens = torch.stack([torch.as_tensor(test[i]) for i in range(n)]).long()
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert summary["test_loss"] == pytest.approx(float(nll), rel=1e-5)
    assert summary["test_perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-4)
