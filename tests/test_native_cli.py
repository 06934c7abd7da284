"""``train.engine=torch`` through the planning verbs (train --dry-run, plan, submit --dry-run, study) and
``bench train`` with both engines; one process, no torchrun. The dry runs plan a GPU run on this CPU
machine (the run plan's gpu=True) and take well under a second each."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from _train_data import TINY_MODEL
from megafixed.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAPER = str(ROOT / "examples" / "configs" / "paper-1.7b-canonical.yaml")
QUICKSTART = str(ROOT / "examples" / "configs" / "quickstart.yaml")


def _json_after(out: str, header: str) -> dict:
    text = out.split(header, 1)[1]
    return json.loads(text[text.index("{"):text.rindex("}") + 1])


def test_dry_run_prints_the_torch_engines_record_for_a_gpu_run(capsys):
    from megafixed.config import load_config
    from megafixed.engine import engine_config
    from megafixed.run_plan import RunPlan

    over = ["train.engine=torch", "torch_engine.dp_replicate=2", "torch_engine.reshard_after_forward=false",
            "parallel.tp=2", "data.mock=true", "train.compile=true"]
    assert main(["train", PAPER, "--dry-run", "--world-size", "16", *over]) == 0
    out = capsys.readouterr().out
    assert "# deepspeed config" not in out
    rec = _json_after(out, "# torch engine config (written to <run_dir>/torch_engine.json by a real run)")
    # 16 ranks = tp 2 x dp 8; dp = 2 replicas x 4 shards, in the mesh's dim order
    assert rec["mesh"]["dim_names"] == ["dp_replicate", "dp_shard", "tp"] and rec["mesh"]["shape"] == [2, 4, 2]
    dp = rec["data_parallel"]
    assert (dp["mode"], dp["replicate_degree"], dp["shard_degree"]) == ("hsdp", 2, 4)
    assert dp["reshard_after_forward"] is False and dp["sharded_states"] == ["params", "grads", "optimizer"]
    # a GPU run planned on a CPU machine: bf16 compute, fp32 masters and fp32 gradient reduction
    assert rec["mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32",
                                      "master_dtype": "float32", "precision": "bf16", "by": "MixedPrecisionPolicy"}
    assert rec["device"] == "cuda" and rec["backend"] == "nccl" and rec["compile"]["enabled"] is True
    assert rec["tensor_parallel"]["degree"] == 2 and rec["pipeline_parallel"]["degree"] == 1
    cfg = load_config(PAPER, over)
    b = RunPlan.build(cfg, 16, gpu=True).batch
    assert rec["batch"]["global_batch"] == b.micro_batch * b.accum * 8 == cfg.train.global_batch
    assert rec == json.loads(json.dumps(engine_config(cfg, RunPlan.build(cfg, 16, gpu=True))))  # the seam's record
    assert "engine torch, hsdp (dp_replicate 2 x dp_shard 4)" in out and "Nothing was started" in out
    # the DeepSpeed plan of the same config still prints DeepSpeed's JSON
    assert main(["train", PAPER, "--dry-run", "--world-size", "16", "parallel.tp=2", "data.mock=true"]) == 0
    ds = _json_after(capsys.readouterr().out, "# deepspeed config (written to <run_dir>/ds_config.json")
    assert ds["bf16"]["enabled"] and "zero_optimization" in ds


@pytest.mark.parametrize("verb,refused,words", [
    # a pipeline schedule's constraint (tests/test_native_pipeline.py has each of them)
    ("train", ("parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble"), ("parallel.pp_schedule=ZBVZeroBubble",
                                                                       "exactly 2 stages per rank", "parallel.vpp")),
    ("submit", ("parallel.pp=2", "parallel.vpp=2"), ("parallel.pp_schedule=1F1B", "one stage per rank",
                                                     "parallel.vpp=2")),
    # a study trains here (one process, dp 1): its runs are planned before the first one starts
    ("study", ("torch_engine.dp_replicate=2",), ("torch_engine.dp_replicate=2", "does not divide"))])
def test_what_the_torch_engine_cannot_run_is_refused_by_name(verb, refused, words, tmp_path, capsys):
    over = ["train.engine=torch", *refused, "data.mock=true", f"train.run_dir={tmp_path / 'run'}"]
    argv = {"train": ["train", PAPER, "--dry-run", "--world-size", "16", *over],
            "submit": ["submit", PAPER, "--nodes", "2", "--gpus-per-node", "8", "--dry-run", *over],
            "study": ["study", QUICKSTART, "--interfaces", "canonical", "--seeds", "0", "--out",
                      str(tmp_path / "study"), *over]}[verb]
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error:"), captured.err
    assert all(w in err[0] for w in words), err[0]
    assert not (tmp_path / "run").exists() and not (tmp_path / "study").exists()


def test_submit_dry_run_plans_the_torch_engine_and_passes_the_key_on(tmp_path, capsys):
    over = ["train.engine=torch", "torch_engine.dp_replicate=8", "data.mock=true", f"train.run_dir={tmp_path / 'r'}"]
    assert main(["submit", PAPER, "--nodes", "2", "--gpus-per-node", "8", "--dry-run", *over]) == 0
    script = capsys.readouterr().out
    assert "train.engine=torch" in script and "torch_engine.dp_replicate=8" in script
    assert not (tmp_path / "r").exists()
    # a replicate degree that does not divide DP (16 ranks): refused here, not after the queue
    assert main(["submit", PAPER, "--nodes", "2", "--gpus-per-node", "8", "--dry-run", "train.engine=torch",
                 "torch_engine.dp_replicate=3", "data.mock=true"]) == 2
    assert "dp_replicate" in capsys.readouterr().err


def test_study_dry_run_lists_torch_engine_runs(tmp_path, capsys):
    assert main(["study", QUICKSTART, "--interfaces", "canonical,gf2", "--seeds", "0", "--out",
                 str(tmp_path / "s"), "--dry-run", "train.engine=torch", "data.mock=true"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "to train" in ln]
    assert len(lines) == 2


def test_plan_estimates_fsdp2_as_sharding_params_grads_and_optimizer_over_dp(capsys):
    from megafixed.config import load_config
    from megafixed.parallel.memory import layer_params

    assert main(["plan", PAPER, "--gpus", "8", "--json", "--all", "train.engine=torch"]) in (0, 1)
    r = json.loads(capsys.readouterr().out)
    assert r["engine"] == "torch" and r["layouts"]
    cfg = load_config(PAPER, [])
    m = cfg.model
    for row in r["layouts"]:
        lay = row["layout"]
        assert lay["engine"] == "torch"
        shard = lay["dp"] * lay.get("cp", 1) // lay["dp_replicate"]  # FSDP2 shards over dp x cp
        n = row["params_count"]
        per_layer = layer_params(m, lay["tp"])
        if lay["pp"] > 1:  # the engine's split: input and head count as a layer each, 34 / pp slots per stage
            per = (m.n_layers + 2) // lay["pp"]
            first, last = per_layer[0] + (per - 1) * per_layer[1], (per - 1) * per_layer[1] + per_layer[-1]
            assert n in (first, last) and row["pipeline"]["schedule"] == "1F1B"  # the most loaded rank's
            assert row["pipeline"]["bubble_fraction"] == pytest.approx((lay["pp"] - 1) / lay["accum"], abs=1e-6)
            # the schedule drives FSDP2: unsharded fp32 gradients accumulate over the microbatches (dp > 1)
            assert row["grads"] == pytest.approx(4 * n / shard + (4 * n if lay["dp"] * lay.get("cp", 1) > 1 else 0))
            continue
        # an independent count: FSDP2 keeps fp32 masters, fp32 gradients and Adam's m and v, all sharded
        assert n == sum(per_layer)
        assert row["optimizer"] == pytest.approx(8 * n / shard)
        # reduce-scattered every micro batch: no unsharded fp32 gradients held between reductions
        assert row["grads"] == pytest.approx(4 * n / shard)
        # bf16 working copies (reshard after forward): two blocks, the input and the head stay gathered;
        # one data x context rank (no FSDP2, autocast): a 16-bit copy of every weight
        gathered = min(n, 2 * per_layer[1] + per_layer[0] + per_layer[-1])
        working = (n if lay["dp"] * lay.get("cp", 1) == 1 else gathered) * 2
        assert row["params"] == pytest.approx(4 * n / shard + working)
    shards = {(row["layout"]["dp"] // row["layout"]["dp_replicate"]) for row in r["layouts"]}
    assert {1, 8} <= shards  # plain replication and full sharding are both listed
    assert main(["plan", PAPER, "--gpus", "8", "train.engine=torch"]) in (0, 1)
    text = capsys.readouterr().out
    assert "FSDP2 shards params, grads and optimizer state over DP" in text and " FSDP " in text


def test_bench_train_measures_both_engines_against_the_bare_loop(tmp_path, capsys):
    import argparse

    from megafixed.bench import train as bt
    from megafixed.config import ConfigError, load_config

    p = argparse.ArgumentParser()
    bt.add_arguments(p)
    out = tmp_path / "t.json"
    args = p.parse_args([QUICKSTART, *TINY_MODEL, "data.mock=true", "train.global_batch=4", "train.micro_batch=2",
                         f"train.run_dir={tmp_path / 'run'}", "--steps", "2", "--warmup-steps", "1", "--rounds",
                         "2", "--json", str(out)])
    assert bt.run(args) == 0
    r = json.loads(out.read_text())
    assert r["engines"] == ["deepspeed", "torch"] and r["complete"] is True and r["skipped"] == {}
    for name in ("bare", "deepspeed", "torch"):
        s = r[name]
        assert s["steps_timed"] == 2 and s["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / s["step_s_median"])
    for name in ("deepspeed", "torch"):
        assert r[name]["overhead"] == pytest.approx(r[name]["step_s_median"] / r["bare"]["step_s_median"] - 1)
        assert r[name]["overhead_cpu_time"] == pytest.approx(r[name]["cpu_s_median"] / r["bare"]["cpu_s_median"] - 1)
        assert len(r[name]["cpu_times_s"]) == 2 and all(t > 0 for t in r[name]["cpu_times_s"])
    assert r["framework"] == r["deepspeed"] and r["overhead"] == r["deepspeed"]["overhead"]
    text = capsys.readouterr().out
    assert "framework overhead vs the bare loop: deepspeed " in text and ", torch " in text
    assert not (tmp_path / "run").exists()
    # an engine named on the command line that refuses the config fails by name; by default it is skipped
    refused = [QUICKSTART, *TINY_MODEL, "data.mock=true", "torch_engine.dp_replicate=2"]
    with pytest.raises(ConfigError, match="dp_replicate"):
        bt.run(p.parse_args([*refused, "--engines", "torch"]))
    plans, skipped = bt._plans(load_config(QUICKSTART, refused[1:]), None)
    assert list(plans) == ["deepspeed"] and "dp_replicate" in skipped["torch"]
    assert bt.report_lines(dict(r, skipped=skipped))[-1].startswith("torch     not measured: torch_engine.dp_replicate")


def test_a_torch_engine_run_writes_its_record_as_torch_engine_json(tmp_path):
    """What ``megafixed train`` writes beside config.yaml (the trainer's own call, on a built engine)."""
    from megafixed.config import load_config
    from megafixed.engine import build_engine, engine_config
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.trainer import _write_run_files

    cfg = load_config(QUICKSTART, [*TINY_MODEL, "data.mock=true", "train.engine=torch", f"train.run_dir={tmp_path}"])
    plan = RunPlan.for_launch(cfg)
    topo = setup_distributed(plan)
    build_engine(cfg, topo)
    _write_run_files(cfg, topo)  # as the trainer does, once the engine is built
    record = json.loads((tmp_path / "torch_engine.json").read_text())
    assert record == json.loads(json.dumps(engine_config(cfg, plan)))
    assert record["device"] == "cpu" and record["mixed_precision"]["param_dtype"] == "float32"
    assert record["data_parallel"]["mode"] == "single" and record["data_parallel"]["fully_shard_units"] == []
    assert (tmp_path / "config.yaml").exists() and not (tmp_path / "ds_config.json").exists()
