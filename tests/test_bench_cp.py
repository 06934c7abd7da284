"""``megafixed bench cp``: a tiny model at cp 1 and 2, and the JSON it writes (no timing is asserted)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.code_bits=8",
        "train.global_batch=2", "train.micro_batch=2"]


def test_bench_cp_reports_memory_and_tokens_per_s_against_cp_1(tmp_path, capsys):
    from megafixed.bench import cp as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    out = tmp_path / "cp.json"
    args = p.parse_args([str(ROOT / "examples/configs/quickstart.yaml"), *TINY, "--cp", "1,2", "--seq-lens", "64",
                         "--steps", "1", "--warmup-steps", "0", "--json", str(out)])
    assert bench.run(args) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "cp" and r["cp"] == [1, 2] and r["seq_lens"] == [64] and r["engine"] == "torch"
    rows = {row["cp"]: row for row in r["rows"]}
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        assert row["seq_len"] == 64 and row["tokens_per_step"] == 2 * 64 and len(row["step_times_s"]) == 1
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_s_median"])
        assert row["peak_bytes"] > 0 and 0 < row["activation_bytes"] <= row["peak_bytes"]
        assert row["analytic_activation_bytes"] > 0
    assert rows[1]["activation_vs_cp1"] == rows[1]["tokens_per_s_vs_cp1"] == 1.0
    assert rows[2]["activation_vs_cp1"] == pytest.approx(rows[2]["activation_bytes"] / rows[1]["activation_bytes"])
    assert rows[2]["tokens_per_s_vs_cp1"] == pytest.approx(rows[2]["tokens_per_s"] / rows[1]["tokens_per_s"])
    # the measured all-to-alls of the tracked steps (the second): four a layer each way, each of one rank's
    # [2, 32, 4, 16] fp32 q/k/v/output; none at cp 1
    assert rows[1]["cp_all_to_all_bytes"] == 0
    assert rows[2]["cp_all_to_all_bytes"] == 2 * 8 * (2 * 32 * 4 * 16 * 4)
    assert "tokens/s" in capsys.readouterr().out
