"""Pipeline parallelism in the torch engine (``parallel.pp``, ``torch.distributed.pipelining``), and
FSDP2 with gradient accumulation, each against one process (fp32, gloo, clipping on every step).

- two launches of ``native_pipeline_worker.py`` (2 and 4 ranks) train every layout 4 steps beside
  the in-process single-process reference: PP2 with 1F1B, Interleaved1F1B (vpp 2) and
  ZBVZeroBubble; DP2 with 4 micro batches per rank; PP2 x DP2 (FSDP2, checkpointed blocks);
  PP2 x TP2 with SP (GPipe); HSDP 2 x 2 with 2 micro batches per rank: losses, gradient norms and
  validation (of the step's micro-batch count and of another) within 1e-5, every gradient after
  step 1 within 1e-5 of the largest;
- in the same launches, ``model.fused_first_layer=true`` at DP2 (FSDP2, also compiled), PP2, HSDP
  2 x 2, TP2 x DP2 with SP, PP2 x TP2 and PP2 x DP2, each within 1e-5 of one process and of the
  same layout unfused;
- through ``megafixed train``: a PP2 run killed with SIGKILL between saves and rerun logs the
  uninterrupted PP2 run's numbers bit for bit; that run's step-2 checkpoint resumed on one
  process (PP1) and a PP1 checkpoint resumed at PP2 with another schedule continue within 1e-5;
- the refusals, each in one line, before any process group; the bubble from the schedule's own
  action table against the closed forms.
"""
from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest

from _metrics import assert_rows_match, logged_step, read_metrics
from _train_data import reference_overrides
from megafixed.config import ConfigError, load_config
from megafixed.run_plan import RunPlan

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-5
TINY = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.code_bits=8",
        "model.max_seq_len=32", "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2",
        "train.engine=torch"]


# ----------------------------------------------------------------------------------- refusals, split, bubble
@pytest.mark.parametrize("overrides,world,needle", [
    (["parallel.pp_schedule=Zigzag"], 2, "parallel.pp_schedule='Zigzag' is not a torch.distributed.pipelining "
                                         "schedule; use one of GPipe, 1F1B"),
    (["parallel.vpp=2"], 2, "parallel.pp_schedule=1F1B runs one stage per rank, but parallel.vpp=2"),
    (["parallel.pp_schedule=Interleaved1F1B"], 2, "parallel.pp_schedule=Interleaved1F1B runs several stages per "
                                                  "rank; set parallel.vpp >= 2"),
    (["parallel.pp_schedule=ZBVZeroBubble", "parallel.vpp=3", "model.n_layers=4"], 2,
     "parallel.pp_schedule=ZBVZeroBubble needs exactly 2 stages per rank (a V), but parallel.vpp=3"),
    (["train.micro_batch=4", "train.global_batch=4"], 2, "parallel.pp_schedule=1F1B needs at least 2 "
                                                         "microbatches per step"),
    (["parallel.pp_schedule=DualPipeV", "parallel.vpp=2", "train.global_batch=4"], 2,
     "parallel.pp_schedule=DualPipeV needs at least 4 microbatches per step"),
    (["parallel.pp_schedule=ZBVZeroBubble", "parallel.vpp=2", "train.compile=true"], 2,
     "parallel.pp_schedule=ZBVZeroBubble splits each backward into input and weight parts"),
    (["model.n_layers=3"], 2, "model.n_layers=3 blocks plus the input and the head (each counted as "
                              "parallel.pp_input_head_layers=1 layers) make 5 layers, which do not divide into 2"),
    (["parallel.pp_input_head_layers=0", "model.n_layers=3"], 2, "make 3 layers, which do not divide into 2"),
])
def test_each_schedule_constraint_is_refused_in_one_line_by_the_plan(overrides, world, needle):
    cfg = load_config(None, [*TINY, "parallel.pp=2", *overrides])
    with pytest.raises(ConfigError) as info:
        RunPlan.build(cfg, world, gpu=False)  # before any process group: --dry-run and `plan` see it too
    message = str(info.value)
    assert needle in message and "\n" not in message, message


@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
@pytest.mark.parametrize("keys,named", [
    (["parallel.pp_schedule=GPipe"], "parallel.pp_schedule=GPipe"),
    (["parallel.vpp=2"], "parallel.vpp=2"),
    (["parallel.pp_schedule=Interleaved1F1B", "parallel.vpp=2"],
     "parallel.pp_schedule=Interleaved1F1B, parallel.vpp=2"),
])
def test_a_pipeline_schedule_without_a_pipeline_is_refused_in_one_line(engine, keys, named, capsys):
    from megafixed.cli import main

    code = main(["train", "/dev/null", "--dry-run", "--world-size", "2", *TINY, f"train.engine={engine}",
                 "data.mock=true", *keys])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), lines
    assert f"{named} configures pipeline parallelism, but parallel.pp=1 runs no pipeline" in lines[0], lines[0]
    # the schedule's default name in any case is no schedule of its own
    assert RunPlan.build(load_config(None, [*TINY, "parallel.pp_schedule=1f1b"]), 2, gpu=False).pp == 1


def test_init_from_refuses_source_keys_no_pipeline_stage_holds_as_it_does_without_pp(tmp_path):
    """Under PP every rank reads the source and keeps its stage's part; a key that no stage holds
    is refused with the same line as without PP, not dropped."""
    import torch

    from megafixed.engine.native.checkpoint import DcpCheckpoint
    from megafixed.model.gpt import GPT
    from megafixed.run.optim import build_optimizer

    cfg = load_config(None, TINY)
    model = GPT(cfg.model, seed=1)
    ckpt = DcpCheckpoint(model, build_optimizer(model, cfg.optimizer))
    source = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.every_rank_reads = True  # what PipelineEngine sets
    ckpt.load_weights(lambda: source, tmp_path)  # the same keys: loads
    source["blocks.7.attn.wq.weight"] = torch.zeros(64, 64)  # a block this 2-layer model has not
    said = {}
    for every in (True, False):
        ckpt.every_rank_reads = every
        with pytest.raises(ConfigError) as info:
            ckpt.load_weights(lambda: source, tmp_path)
        said[every] = str(info.value)
    assert said[True] == said[False] and "extra ['blocks.7.attn.wq.weight']" in said[True], said
    assert "\n" not in said[True]


def test_the_deepspeed_engine_keeps_its_1f1b_and_refuses_other_schedules_by_name():
    cfg = load_config(None, [*TINY, "train.engine=deepspeed", "parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble",
                             "parallel.vpp=2"])
    with pytest.raises(ConfigError, match=r"train\.engine=deepspeed runs the 1F1B pipeline schedule only"):
        RunPlan.build(cfg, 2, gpu=False)
    assert RunPlan.build(load_config(None, [*TINY, "train.engine=deepspeed", "parallel.pp=2"]), 2, gpu=False).pp == 2


def test_every_library_schedule_name_plans():
    for name, vpp in (("GPipe", 1), ("1F1B", 1), ("interleaved1f1b", 2), ("LoopedBFS", 2),
                      ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2)):
        cfg = load_config(None, [*TINY, "train.micro_batch=1", "parallel.pp=2", f"parallel.pp_schedule={name}",
                                 f"parallel.vpp={vpp}"])
        assert RunPlan.build(cfg, 2, gpu=False).pp == 2


def test_the_split_counts_input_and_head_as_layers_and_keeps_global_names():
    from megafixed.engine.native.pipeline import PipelineParts, StageModule
    from megafixed.engine.native.schedules import stage_ids, stage_spans
    from megafixed.model.gpt import meta_gpt

    spans = stage_spans(6, 4)  # 8 slots: [in b0] [b1 b2] [b3 b4] [b5 head]
    assert [list(s.blocks) for s in spans] == [[0], [1, 2], [3, 4], [5]]
    assert [(s.has_input, s.has_head) for s in spans] == [(True, False), (False, False), (False, False),
                                                          (False, True)]
    assert [list(s.blocks) for s in stage_spans(4, 2, edge=0)] == [[0, 1], [2, 3]]
    assert stage_ids(0, 2, 2, v_shaped=False) == [0, 2] and stage_ids(0, 2, 2, v_shaped=True) == [0, 3]
    cfg = load_config(None, [*TINY, "model.n_layers=6"])
    gpt = meta_gpt(cfg.model)
    ids = stage_ids(1, 2, 2, v_shaped=True)  # rank 1 of a V: stages 1 and 2
    parts = PipelineParts(gpt, [spans[i] for i in ids])
    names = {n for n, _ in parts.named_parameters()}
    assert names == {n for n, _ in gpt.named_parameters() if n.split(".")[:2] in (["blocks", str(b)]
                                                                               for b in (1, 2, 3, 4))}
    assert {n for n, _ in StageModule(gpt, spans[3]).named_parameters()} == \
        {n for n, _ in gpt.named_parameters() if n.startswith(("blocks.5.", "head."))}


@pytest.mark.parametrize("schedule,vpp", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2)])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4)])
def test_the_bubble_from_the_action_table_is_the_formula(schedule, vpp, pp, m):
    from megafixed.engine.native.bubble import bubble

    b = bubble(schedule, pp, m, vpp)
    assert math.isclose(b.fraction, (pp - 1) / (vpp * m), rel_tol=1e-12), b
    assert math.isclose(b.formula, (pp - 1) / (vpp * m))
    if schedule == "1F1B":  # stage i holds pp - i microbatches in flight
        assert b.in_flight == [min(pp - i, m) for i in range(pp)]
    if schedule == "GPipe":
        assert b.in_flight == [m] * pp


def test_zero_bubble_schedules_beat_the_interleaved_formula():
    from megafixed.engine.native.bubble import bubble

    for name in ("InterleavedZeroBubble", "ZBVZeroBubble"):
        b = bubble(name, 4, 8, 2)
        assert 0 <= b.fraction < b.formula / 2, b


PAPER = str(ROOT / "examples" / "configs" / "paper-1.7b-canonical.yaml")


@pytest.mark.parametrize("schedule,vpp,edge", [("1F1B", 1, 1), ("Interleaved1F1B", 2, 0), ("ZBVZeroBubble", 2, 0)])
def test_plan_and_dry_run_show_the_schedule_bubble_and_in_flight_activations(schedule, vpp, edge, capsys):
    from megafixed.cli import main
    from megafixed.engine.native.bubble import bubble

    # global batch 64: at most 64 microbatches (the library builds a table per row; big ones take seconds)
    keys = ["train.engine=torch", f"parallel.pp_schedule={schedule}", f"parallel.vpp={vpp}",
            f"parallel.pp_input_head_layers={edge}", "train.global_batch=64"]
    assert main(["plan", PAPER, "--gpus", "8", "--json", "--all", *keys]) in (0, 1)
    rows = [r for r in json.loads(capsys.readouterr().out)["layouts"] if r["layout"]["pp"] > 1]
    assert rows and all(r["pipeline"]["schedule"] == schedule for r in rows)
    compared = 0
    for r in rows:
        p, m, got = r["layout"]["pp"], r["layout"]["accum"], r["pipeline"]
        assert got["bubble_formula"] == pytest.approx((p - 1) / (vpp * m), abs=1e-6)
        # the closed forms assume whole rounds of p microbatches (with fewer, the library's flexible
        # interleaving runs partial rounds, and the table's bubble is larger than the formula)
        if m % p == 0:
            compared += 1
            if schedule == "ZBVZeroBubble":
                assert got["bubble_fraction"] < got["bubble_formula"], r
            else:
                assert got["bubble_fraction"] == pytest.approx(got["bubble_formula"], abs=1e-6), r
        assert sum(got["activation_bytes_per_stage"].values()) <= r["activations"] * p * vpp  # per-stage bytes
    assert compared
    assert main(["train", PAPER, "--dry-run", "--world-size", "8", "parallel.pp=2", "data.mock=true", *keys]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("# pipeline:"))
    assert schedule in line and "in flight" in line and "bubble" in line, line
    record = json.loads(out.split("(written to <run_dir>/torch_engine.json by a real run)\n", 1)[1].split("\n# ")[0])
    pipe = record["pipeline_parallel"]
    assert (pipe["schedule"], pipe["degree"], pipe["stages_per_rank"]) == (schedule, 2, vpp)
    assert pipe["bubble_fraction"] == pytest.approx(bubble(schedule, 2, pipe["microbatches"], vpp).fraction, abs=1e-6)


# ----------------------------------------------------------------------------------- against one process
def _worker(torchrun, tmp_path, nproc: int, cases: list[str]) -> dict:
    out = tmp_path / f"w{nproc}.json"
    torchrun(nproc, [str(ROOT / "tests" / "native_pipeline_worker.py"), str(out), *cases])
    return json.loads(out.read_text())


def _assert_like_one_process(results: dict, cases: list[str]) -> None:
    assert sorted(results) == sorted(cases)
    for name, r in results.items():
        for key in ("loss", "grad_norm"):
            for step, (a, b) in enumerate(zip(r[key], r[f"ref_{key}"]), 1):
                assert math.isclose(a, b, rel_tol=RTOL), f"{name} ({r['describe']}): step {step} {key} {a} vs {b}"
        assert all(n > 0.05 for n in r["ref_grad_norm"])  # optimizer.grad_clip=0.05: every step was clipped
        assert r["grad_rel_diff"] < RTOL, f"{name}: gradients after step 1 differ by {r['grad_rel_diff']:.2e}"
        assert math.isclose(r["val"], r["ref_val"], rel_tol=RTOL), (name, r["val"], r["ref_val"])
        # a validation pass of another micro-batch count than the step's (validation.iters is any number)
        assert math.isclose(r["val_odd"], r["ref_val_odd"], rel_tol=RTOL), (name, r["val_odd"], r["ref_val_odd"])


TWO_RANKS = ["pp2_1f1b", "pp2_interleaved", "pp2_zbv", "dp2_accum4"]
FOUR_RANKS = ["pp2_dp2", "pp2_tp2_sp", "hsdp2x2_accum2"]
# model.fused_first_layer=true (GF(2) code), each case beside its unfused twin at the same layout
FUSED_TWO_RANKS = ["dp2_fused", "pp2_fused", "dp2_fused_compiled"]
FUSED_FOUR_RANKS = ["hsdp2x2_fused", "tp2_dp2_sp_fused", "pp2_tp2_fused", "pp2_dp2_fused"]


@pytest.fixture(scope="module")
def two_ranks(torchrun, tmp_path_factory) -> dict:
    """Every 2-rank case of this file in one launch."""
    return _worker(torchrun, tmp_path_factory.mktemp("two_ranks"), 2, TWO_RANKS + FUSED_TWO_RANKS)


@pytest.fixture(scope="module")
def four_ranks(torchrun, tmp_path_factory) -> dict:
    """Every 4-rank case of this file in one launch."""
    return _worker(torchrun, tmp_path_factory.mktemp("four_ranks"), 4, FOUR_RANKS + FUSED_FOUR_RANKS)


def _only(results: dict, cases: list[str]) -> dict:
    return {k: v for k, v in results.items() if k in cases}


@pytest.mark.multiprocess
def test_pipeline_schedules_and_fsdp2_accumulation_on_two_ranks_equal_one_process(two_ranks):
    results = _only(two_ranks, TWO_RANKS)
    _assert_like_one_process(results, TWO_RANKS)
    assert "micro 1 x accum 4 x dp 2" in results["dp2_accum4"]["describe"]


@pytest.mark.multiprocess
def test_pipeline_with_fsdp2_and_with_tp_and_hsdp_accumulation_on_four_ranks_equal_one_process(four_ranks):
    results = _only(four_ranks, FOUR_RANKS)
    _assert_like_one_process(results, FOUR_RANKS)
    assert "tp 1 x pp 2 x dp 2" in results["pp2_dp2"]["describe"]
    assert "tp 2 x pp 2 x dp 1" in results["pp2_tp2_sp"]["describe"]


def _assert_fused_like_unfused(results: dict, cases: list[str]) -> None:
    """Each fused case equals one process (unfused) and its unfused twin at the same layout, and the
    fused block really ran (on the ranks that hold block 0) where the twin never did."""
    results = _only(results, cases)
    _assert_like_one_process(results, cases)
    for name, r in results.items():
        twin = r["unfused"]
        for key in ("loss", "grad_norm"):
            for step, (a, b) in enumerate(zip(r[key], twin[key]), 1):
                assert math.isclose(a, b, rel_tol=RTOL), f"{name} ({r['describe']}): step {step} {key} {a} vs {b}"
        assert math.isclose(r["val"], twin["val"], rel_tol=RTOL), (name, r["val"], twin["val"])
        assert twin["grad_rel_diff"] < RTOL, f"{name}: gradients differ from unfused by {twin['grad_rel_diff']:.2e}"
        assert twin["fused_path_taken"] > 0 and twin["unfused_took_it"] == 0, (name, twin)


@pytest.mark.multiprocess
def test_the_fused_first_layer_under_fsdp2_compile_and_in_the_first_pipeline_stage_equals_unfused(two_ranks):
    _assert_fused_like_unfused(two_ranks, FUSED_TWO_RANKS)
    assert "tp 1 x pp 2 x dp 1" in two_ranks["pp2_fused"]["describe"]


@pytest.mark.multiprocess
def test_the_fused_first_layer_under_hsdp_tp_sp_and_pp_with_fsdp2_equals_unfused(four_ranks):
    _assert_fused_like_unfused(four_ranks, FUSED_FOUR_RANKS)
    assert "tp 2 x pp 1 x dp 2" in four_ranks["tp2_dp2_sp_fused"]["describe"]
    assert "micro 1 x accum 2 x dp 4" in four_ranks["hsdp2x2_fused"]["describe"]
    # HSDP, not FSDP over 4: the parameters live on the 2 x 2 (replicate, shard) mesh
    assert four_ranks["hsdp2x2_fused"]["meshes"] == ['[["dp_replicate", "dp_shard"], [2, 2]]'], four_ranks


# ----------------------------------------------------------------------------------- checkpoints, kill -9
STEPS, SAVE = 6, 2
NATIVE = ("train.engine=torch", f"train.max_steps={STEPS}", f"checkpoint.interval={SAVE}",
          f"schedule.decay_steps={STEPS}", "checkpoint.keep=0", "train.micro_batch=2")
PP2 = ("parallel.pp=2",)


def _overrides(shards, run_dir, *extra) -> list[str]:
    return reference_overrides(shards, run_dir, "learned", *NATIVE, *extra)


@pytest.fixture(scope="module")
def pp2_reference(tiny_shards, tmp_path_factory):
    """The uninterrupted PP2 (1F1B) run, started at once so that the kill test's victim runs beside it."""
    from test_native_checkpoint import _Background, _kill9

    run_dir = tmp_path_factory.mktemp("pp2_ref") / "run"
    ref = _Background(2, _overrides(tiny_shards, run_dir, *PP2), run_dir)
    yield ref
    if ref.proc.poll() is None:
        _kill9(ref.proc)
        ref.proc.wait()


def _assert_continues(run_dir, ref_dir, first: int):
    got, want = read_metrics(run_dir, "loss"), read_metrics(ref_dir, "loss")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_rows_match(got[first:], want[first:], f"{run_dir} vs the uninterrupted PP2 run",
                      keys=("consumed_samples", "loss", "grad_norm"))


@pytest.mark.multiprocess
def test_a_pp2_run_killed_between_saves_reruns_bit_identically(tiny_shards, pp2_reference, tmp_path):
    from test_native_checkpoint import _kill9, _popen, _run

    from _pause import ended, pause_env, wait_paused

    run_dir = tmp_path / "run"
    overrides = _overrides(tiny_shards, run_dir, *PP2)
    # stage 0 (rank 0) stops before step SAVE + 2 (past a complete checkpoint, before the next one), stage 1
    # waits for it, until both are killed there
    paused = tmp_path / "victim.paused"
    victim = _popen(2, overrides, tmp_path / "victim.log", pause_env(f"train.step@{SAVE + 2}:rank=0", paused))
    latest = run_dir / "checkpoints" / "latest"
    wait_paused(paused, ended(victim, tmp_path / "victim.log"))
    saved = int(latest.read_text().strip().split("_")[1])
    killed_at = logged_step(run_dir)
    _kill9(victim)
    victim.wait()
    assert killed_at is not None, "the run ended before it could be killed: " + \
        (tmp_path / "victim.log").read_text()[-3000:]
    assert victim.returncode == -signal.SIGKILL and saved < STEPS, (saved, killed_at)
    rerun = _run(2, overrides)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-4000:]
    assert any(ln.startswith("resumed from") and f"(step {saved}," in ln for ln in rerun.stdout.splitlines()), \
        rerun.stdout[-3000:]
    keys = ("step", "loss", "grad_norm", "consumed_samples", "lr")
    got, want = read_metrics(run_dir, "loss"), read_metrics(pp2_reference.wait(), "loss")
    assert [r["step"] for r in want] == list(range(1, STEPS + 1))
    assert [{k: r.get(k) for k in keys} for r in got] == [{k: r.get(k) for k in keys} for r in want]  # same bits


@pytest.mark.multiprocess
def test_pp2_checkpoint_resumes_on_one_process_and_pp1_resumes_at_pp2_with_another_schedule(
        tiny_shards, pp2_reference, tmp_path):
    from test_native_checkpoint import _rewind, _run

    ref_dir = pp2_reference.wait()
    one = _rewind(ref_dir, tmp_path / "one", "step_00000002")  # PP2's step 2, continued at PP1 to step 4
    proc = _run(1, _overrides(tiny_shards, one, "train.max_steps=4"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    resumed = next(line for line in proc.stdout.splitlines() if line.startswith("resumed from"))
    assert "(step 2, 16 samples consumed)" in resumed and "layout: parallel.pp 2 -> 1" in resumed, resumed
    # PP1's step 4 continued at PP2 on ZBVZeroBubble (two stages per rank, a V) to the end
    back = _rewind(one, tmp_path / "back", "step_00000004")
    proc = _run(2, _overrides(tiny_shards, back, *PP2, "parallel.pp_schedule=ZBVZeroBubble", "parallel.vpp=2"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    resumed = next(line for line in proc.stdout.splitlines() if line.startswith("resumed from"))
    assert "(step 4, 32 samples consumed)" in resumed and "layout: parallel.pp 1 -> 2" in resumed, resumed
    _assert_continues(back, ref_dir, 2)  # steps 3-4 at PP1, 5-6 at PP2 ZBV: the uninterrupted run's numbers
