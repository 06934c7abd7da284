"""Data parallelism: two gloo processes (torchrun) log the same global-batch losses as one process
at the same global batch (fp32, within 1e-5 relative)."""
from __future__ import annotations

from pathlib import Path

import pytest

from _metrics import read_metrics
from _train_data import tiny_overrides, write_shards
from megafixed.config import load_config


def losses(run_dir: Path) -> dict:
    return {r["step"]: r for r in read_metrics(run_dir)}


@pytest.mark.multiprocess
def test_two_process_dp_matches_one_process(tmp_path, torchrun):
    from megafixed.train.trainer import train

    prefix = write_shards(tmp_path / "data")
    common = ["train.max_steps=12", "train.global_batch=8", "train.micro_batch=2", "validation.interval=6",
              "checkpoint.interval=6", "model.input=canonical"]
    # One process: 8 = 2 x accum 4 x dp 1 (in this pytest process).
    one = tmp_path / "one"
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan

    cfg = load_config(None, tiny_overrides(prefix, one, *common))
    train(cfg, setup_distributed(RunPlan.for_launch(cfg)), log=lambda *_: None)
    # Two processes: 8 = 2 x accum 2 x dp 2, through the real CLI under torchrun.
    two = tmp_path / "two"
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    proc = torchrun(2, ["-m", "megafixed.cli", "train", str(cfg), *tiny_overrides(prefix, two, *common)])
    assert "dp 2" in proc.stdout and "accum 2" in proc.stdout

    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) and len(a) == 13  # steps 0..12
    for step in a:
        assert a[step].keys() == b[step].keys(), (step, sorted(a[step].keys() ^ b[step].keys()))
        for key in ("loss", "val_loss", "grad_norm"):
            if key in a[step]:
                assert b[step][key] == pytest.approx(a[step][key], rel=1e-5), (step, key)
        assert a[step]["consumed_samples"] == b[step]["consumed_samples"]
    assert a[12]["loss"] < a[1]["loss"]
    # Both ranks' checkpoint shards exist (ZeRO-1 partitions the optimizer over the 2 ranks).
    ckpt = two / "checkpoints" / "step_00000012"
    assert len(list(ckpt.glob("zero_pp_rank_*_optim_states.pt"))) == 2
