"""``megafixed plan``'s order (its own step-time bound among the rows that fit), ``--pick K`` and
``submit --layout best``; the counts the plan's columns rest on (a schedule's activations in flight,
the collective counter's kinds)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megafixed.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
PAPER = str(ROOT / "examples" / "configs" / "paper-1.7b-canonical.yaml")
MEM = "3.01GiB"  # the 3 GiB reserve and 3-36 MiB of tensors: some rows fit, some do not
LINKS = SimpleNamespace(gpu_type="H100 80GB HBM3", gpus_per_node=8, inter="ib-ndr400")
SMALL = ("model: {vocab_size: 512, d_model: 128, n_heads: 4, n_layers: 4, max_seq_len: 256, code_bits: 9}\n"
         "data: {seq_len: 256, mock: true}\ntrain: {global_batch: 16, engine: ENGINE}\n")


def _row(cfg, gpus, replicate, micro):
    from megafixed.engines import engine_kind
    from megafixed.parallel.memory import estimate
    from megafixed.plan.bound import row_extras

    planner = engine_kind("torch").planner
    e = estimate(cfg.model, cfg.data.seq_len, planner.make_layout(cfg, 1, 1, gpus, replicate, micro, False,
                                                                  "parameters"), "bf16")
    return e, row_extras(cfg, e, LINKS, None, "bf16")


def test_rows_are_ranked_by_their_own_bound_where_the_old_preference_said_otherwise():
    from megafixed.config import load_config
    from megafixed.plan.rank import _old_preference, ranked
    from megafixed.plan.rows import PlanRow

    cfg = load_config(PAPER, ["train.engine=torch"])
    # plain replication (64x1, micro batch 8), HSDP 16x4 at micro batch 1, HSDP 8x8 at micro batch 2: the
    # old preference (the smallest shard degree first) lists them in this order
    a, b, c = rows = [_row(cfg, 64, r, mb) for r, mb in ((64, 8), (16, 1), (8, 2))]
    estimates, table = [e for e, _ in rows], [PlanRow(e, x) for e, x in rows]
    assert sorted(estimates, key=_old_preference) == [a[0], b[0], c[0]]
    bounds = [x["step_time_estimate"]["step_s_lower_bound"] for _, x in rows]
    assert bounds[0] > bounds[1] > bounds[2]  # the 64-rank all-reduce over InfiniBand costs the most
    assert [r.estimate for r in ranked(table, budget=80 * 2 ** 30)] == [c[0], b[0], a[0]]
    # ...and a row that does not fit goes after every row that does, however fast
    assert ranked(table, budget=c[0].total - 1)[-1].estimate is c[0]


def _config(tmp_path, engine="torch") -> Path:
    cfg = tmp_path / f"{engine}.yaml"
    cfg.write_text(SMALL.replace("ENGINE", engine))
    return cfg


def _plan_json(tmp_path, capsys, *args, engine="torch") -> dict:
    cfg = _config(tmp_path, engine)
    capsys.readouterr()
    cli_main(["plan", str(cfg), *args, "--json"])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
def test_the_table_is_sorted_by_its_bound_then_memory_and_unjudged_rows_come_after(tmp_path, capsys, engine):
    out = _plan_json(tmp_path, capsys, "--gpus", "8", "--gpu-mem", MEM, "--all", engine=engine)
    rows = out["layouts"]
    assert [r["row"] for r in rows] == list(range(1, len(rows) + 1))
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)  # the fitting rows first
    judged = [r for r in rows if r["fits"] and not r["not_judged"]]
    keys = [(r["step_time_estimate"]["step_s_lower_bound"], r["total"]) for r in judged]
    assert keys == sorted(keys) and len(judged) > 3
    unjudged = [r for r in rows if r["fits"] and r["not_judged"]]
    if engine == "deepspeed":  # its pipeline rows: no model of their stages
        assert unjudged and all(r["layout"]["pp"] > 1 for r in unjudged)
        assert rows.index(unjudged[0]) == len(judged)
    else:  # the torch engine's pipeline is modelled (its bubble stretches the compute)
        assert not unjudged and any(r["layout"]["pp"] > 1 for r in judged)
        pp = next(r for r in judged if r["layout"]["pp"] > 1)
        assert pp["step_time_estimate"]["bubble"] == pp["pipeline"]["bubble_fraction"] > 0


def test_pick_prints_the_rows_overrides_and_refuses_what_it_cannot_run(tmp_path, capsys):
    from megafixed.config import load_config

    cfg = _config(tmp_path)
    out = _plan_json(tmp_path, capsys, "--gpus", "8", "--gpu-mem", MEM, "--all")
    rows, fitting = out["layouts"], sum(r["fits"] for r in out["layouts"])
    for k in (1, fitting):
        assert cli_main(["plan", str(cfg), "--gpus", "8", "--gpu-mem", MEM, "--pick", str(k)]) == 0
        line = capsys.readouterr().out.strip()
        assert "\n" not in line and line.split() == rows[k - 1]["overrides"]
        lay = rows[k - 1]["layout"]
        picked = load_config(str(cfg), line.split())  # what `megafixed train` would run: that row
        assert (picked.parallel.tp, picked.parallel.pp, picked.torch_engine.dp_replicate, picked.train.micro_batch,
                picked.parallel.sequence_parallel) == (lay["tp"], lay["pp"], lay["dp_replicate"], lay["micro_batch"],
                                                       lay["sequence_parallel"])
    for k, needle in ((fitting + 1, f"--pick {fitting + 1}: row {fitting + 1} does not fit"),
                      (len(rows) + 1, f"--pick {len(rows) + 1}: the plan has {len(rows)} rows"),
                      (0, "--pick 0: the plan has")):
        assert cli_main(["plan", str(cfg), "--gpus", "8", "--gpu-mem", MEM, "--pick", str(k)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and needle in captured.err


def test_submit_layout_best_dry_run_applies_row_one(tmp_path, capsys, monkeypatch):
    from megafixed.plan.best import best_layout

    monkeypatch.chdir(tmp_path)
    cfg = _config(tmp_path)
    out = _plan_json(tmp_path, capsys, "--gpus", "8", "--gpu-mem", MEM)
    first = out["layouts"][0]["overrides"]
    capsys.readouterr()
    assert cli_main(["submit", str(cfg), "--nodes", "2", "--gpus-per-node", "4", "--gpu-mem", MEM,
                     "--layout", "best", "--dry-run"]) == 0
    captured = capsys.readouterr()
    train_line = next(ln for ln in captured.out.splitlines() if "megafixed.cli train" in ln)
    assert " ".join(first) in train_line  # the script runs row 1
    note = next(ln for ln in captured.err.splitlines() if ln.startswith("# --layout best: "))
    assert " ".join(first) in note and "row 1 of the" in note and "megafixed plan" in note
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    choice = best_layout(str(cfg), [], 8, gpu_mem=MEM, gpu_type=LINKS.gpu_type, gpus_per_node=4, inter=LINKS.inter)
    assert choice.as_dict()["overrides"] == first and "--gpus 8" in choice.plan  # what the job record keeps
    # a layout key given by hand and --layout best would fight: one line, exit 2
    assert cli_main(["submit", str(cfg), "parallel.tp=2", "--nodes", "2", "--gpus-per-node", "4",
                     "--layout", "best", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "drop the override parallel.tp" in err[0]


def test_submit_layout_best_records_the_plan_in_the_job_record_and_the_runs_own_record(tmp_path, capsys,
                                                                                         monkeypatch):
    """The job's record (slurm/jobs.jsonl) and, through <run_dir>/plan_choice.json, every checkpoint's run
    record name the plan row the job runs; the job script carries no hidden variable for it."""
    from _train_data import tiny_overrides, write_shards
    from megafixed.config import load_config
    from megafixed.launch import sbatch as slurm
    from megafixed.parallel import setup_distributed
    from megafixed.run import plan_choice
    from megafixed.run_plan import RunPlan
    from megafixed.train.trainer import train

    monkeypatch.chdir(tmp_path)
    cfg = _config(tmp_path)
    first = _plan_json(tmp_path, capsys, "--gpus", "8", "--gpu-mem", MEM)["layouts"][0]["overrides"]
    monkeypatch.setattr(slurm, "sbatch", lambda script, dependency=None: "4242")
    assert cli_main(["submit", str(cfg), "--nodes", "2", "--gpus-per-node", "4", "--gpu-mem", MEM,
                     "--layout", "best"]) == 0
    (entry,) = [json.loads(ln) for ln in next(tmp_path.rglob("jobs.jsonl")).read_text().splitlines()]
    chosen = entry["layout_chosen_by_plan"]
    assert entry["job_id"] == "4242" and chosen["overrides"] == first and chosen["row"] == 1
    assert "megafixed plan" in chosen["chosen_by"] and "--gpus 8" in chosen["chosen_by"]
    # the run directory keeps it, in a file; the script exports nothing for it
    (script,) = [p for p in tmp_path.rglob("*.sbatch")]
    run_dir = script.parent.parent
    assert plan_choice.read(run_dir) == chosen and "LAYOUT" not in script.read_text()
    # another row for the same run directory is refused without --overwrite: one line, exit 2
    plan_choice.write(run_dir, {**chosen, "row": 2}, overwrite=True)
    capsys.readouterr()
    assert cli_main(["submit", str(cfg), "--nodes", "2", "--gpus-per-node", "4", "--gpu-mem", MEM,
                     "--layout", "best"]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("# --layout best: ")]
    assert len(err) == 1 and "plan_choice.json names another layout" in err[0] and "--overwrite" in err[0], err
    assert plan_choice.read(run_dir)["row"] == 2
    assert cli_main(["submit", str(cfg), "--nodes", "2", "--gpus-per-node", "4", "--gpu-mem", MEM,
                     "--layout", "best", "--overwrite"]) == 0
    assert plan_choice.read(run_dir) == chosen
    # a run started in that run directory keeps it in its run record
    said: list = []
    conf = load_config(None, tiny_overrides(write_shards(tmp_path / "shards"), run_dir, "train.max_steps=2",
                                            "checkpoint.interval=2", "validation.interval=0"))
    train(conf, setup_distributed(RunPlan.for_launch(conf)), log=said.append)
    record = json.loads(next((run_dir / "checkpoints").glob("step_*/run.json")).read_text())
    assert record["layout_chosen_by_plan"] == chosen
    assert any(ln.startswith("layout: row 1 of `megafixed plan") for ln in said), said


# ----------------------------------------------------------------------------------- what the columns count
def test_a_zero_bubble_stage_holds_its_activations_until_the_weight_gradient():
    """``bubble.in_flight`` frees a stage's activations at its W (the weight gradient reads them),
    not at its I: a table where W lags I holds more microbatches in flight."""
    from torch.distributed.pipelining.schedules import _Action

    from megafixed.engine.native.bubble import _kind, _leaves, action_table, in_flight

    table = [[_Action.from_str(a) for a in ("0F0", "0I0", "0F1", "0W0", "0I1", "0W1")]]
    assert in_flight(table) == ([2], {0: 2})  # F0 and F1 both held until W0 (an I-release would count 1)
    for schedule, lags in (("InterleavedZeroBubble", True), ("ZBVZeroBubble", False)):
        table = action_table(schedule, 2, 4, 2)
        _, per_stage = in_flight(table)
        # counted by hand from the library's table: F minus I, then F minus W, per stage
        released_at = {}
        for kind in ("I", "W"):
            for row in table:
                held: dict = {}
                for a in (leaf for action in row for leaf in _leaves(action)):
                    k, s = _kind(a), a.stage_index
                    held[s] = held.get(s, 0) + (k == "F") - (k in (kind, "B"))
                    released_at[(kind, s)] = max(released_at.get((kind, s), 0), held[s])
        stages = sorted(per_stage)
        assert [per_stage[s] for s in stages] == [released_at[("W", s)] for s in stages], schedule
        # InterleavedZeroBubble's W lags its I far enough to hold one more microbatch on stages 1 and 3
        assert any(released_at[("W", s)] > released_at[("I", s)] for s in stages) == lags, schedule


def test_what_a_stage_holds_at_its_first_backward_before_any_gradient_exists():
    """GPipe runs every forward before the first backward: its stages hold all m microbatches then, with
    no gradient yet, and one fewer at the later backwards beside the gradients; 1F1B's stage i holds
    pp - i at each (its warm-up, then one in, one out)."""
    from megafixed.engine.native.bubble import bubble

    assert bubble("GPipe", 2, 4).held_at_backward == {0: (4, 3), 1: (4, 3)}
    assert bubble("1F1B", 2, 4).held_at_backward == {0: (2, 2), 1: (1, 1)}
    assert bubble("1F1B", 4, 8).held_at_backward == {i: (4 - i, 4 - i) for i in range(4)}


def test_the_collective_counter_calls_sends_and_receives_p2p():
    import torch

    from megafixed.engine.native.comm_bytes import _collective_ops, kind_of

    ops = _collective_ops()
    for name in ("send", "recv_", "recv_any_source_"):
        packet = getattr(torch.ops.c10d, name)
        assert packet in ops and kind_of(str(packet)) == "p2p", name
    assert kind_of("c10d.allreduce_") == "all_reduce" and kind_of("_c10d_functional.reduce_scatter_tensor") == \
        "reduce_scatter"


def test_the_plan_says_what_zero_reduces_per_micro_batch_with_the_configs_figures(tmp_path, capsys):
    from dataclasses import replace

    from megafixed.config import load_config
    from megafixed.parallel.memory import Layout, tp_param_counts
    from megafixed.parallel.traffic import traffic

    cfg = _config(tmp_path, "deepspeed")
    capsys.readouterr()
    cli_main(["plan", str(cfg), "--gpus", "8", "--top", "1"])
    note = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ZeRO per micro batch:"))
    m = load_config(str(cfg)).model
    per = tp_param_counts(m).total * 2 / 1e9  # bf16 gradients, per rank
    assert f"{per:.1f} GB per micro batch, {2 * per:.1f} GB per step at 2 micro batches" in note
    # the traffic model agrees: ZeRO-2 and -3 reduce-scatter every micro batch, ZeRO-1 once per step (fp16:
    # in bf16 DeepSpeed's ZeRO-1 all-reduces instead, also once)
    for zero, grows in ((1, False), (2, True), (3, True)):
        one = Layout(dp=8, zero=zero, micro_batch=2, accum=1, engine="deepspeed")
        got = [traffic(m, 256, replace(one, accum=a), "fp16").bytes[("dp", "reduce_scatter")] for a in (1, 4)]
        assert got[1] == (4 * got[0] if grows else got[0]), zero
