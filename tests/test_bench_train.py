"""``megafixed bench train``: a tiny config on mock data through both loops, and the JSON it writes."""
from __future__ import annotations

import argparse
import json

import pytest

from _train_data import TINY_MODEL


def test_bench_train_reports_both_loops_and_the_overhead(tmp_path, capsys):
    from megafixed.bench import train as bt

    p = argparse.ArgumentParser()
    bt.add_arguments(p)
    out = tmp_path / "t.json"
    args = p.parse_args([str(__import__("pathlib").Path(__file__).parent.parent / "examples/configs/quickstart.yaml"),
                         *TINY_MODEL, "data.mock=true", "model.fused_first_layer=true", "train.global_batch=4",
                         "train.micro_batch=2", f"train.run_dir={tmp_path / 'run'}", "--steps", "4",
                         "--warmup-steps", "1", "--rounds", "2", "--json", str(out)])
    assert bt.run(args) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "train" and r["mock_data"] is True and r["fused_first_layer"] is True
    assert r["tokens_per_step"] == 4 * 32 and r["accum"] == 2 and r["precision"] == "fp32"
    for name in ("bare", "framework"):
        s = r[name]
        assert s["steps_timed"] == 4 and len(s["step_times_s"]) == 4
        assert s["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / s["step_s_median"])
        assert s["mfu"] is None  # CPU: no bf16 peak to divide by
    assert r["overhead"] == pytest.approx(r["framework"]["step_s_median"] / r["bare"]["step_s_median"] - 1)
    assert r["peak_rss_bytes"]["end"] > 0
    text = capsys.readouterr().out
    assert "framework overhead vs the bare loop" in text and "tokens/s" in text
    assert not (tmp_path / "run").exists()  # a benchmark leaves no run directory behind
    with pytest.raises(Exception, match="already exists"):
        bt.run(args)
