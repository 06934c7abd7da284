"""The run plan (megafixed/run_plan.py): made once from the config and the world, validated once,
before any process group; its grid's named axes against megatron-core's own rank generator."""
from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from _train_data import TINY_MODEL
from megafixed.config import ConfigError, load_config
from megafixed.parallel.dims import GRID_ORDER, ParallelDims
from megafixed.parallel.layout import LayoutError
from megafixed.run_plan import RunPlan

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "configs" / "quickstart.yaml"
# test_parallel.py's tiny model: 4 heads, 2 layers, vocab 512, so tp 2 / pp 2 divide it.
TINY = ["model.vocab_size=512", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=32",
        "data.seq_len=32", "model.code_bits=9", "train.global_batch=8", "train.micro_batch=2", "zero.stage=1"]


def _megatron_ranks(tp: int, dp: int, pp: int, cp: int = 1):
    from megafixed.engine.deepspeed.megatron_tp import load  # megatron-core's own module, without its __init__

    return load().parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")


def test_quickstart_plan_on_cpu_and_for_gpus():
    cfg = load_config(str(QUICKSTART), [])
    t = cfg.train
    cpu = RunPlan.build(cfg, 1, gpu=False)
    assert cpu.dims.axes == (("tp", 1), ("dp", 1), ("pp", 1)) and cpu.world_size == 1
    assert (cpu.batch.global_batch, cpu.batch.micro_batch, cpu.batch.dp) == (t.global_batch, t.micro_batch, 1)
    assert cpu.batch.accum * cpu.batch.micro_batch == t.global_batch and cpu.batch.accum == 2  # 32 = 16 x 2
    assert cpu.batch.per_rank == t.global_batch
    assert cpu.batch.tokens_per_step == t.global_batch * cfg.data.seq_len == 32 * 128
    assert (cpu.precision, cpu.device, cpu.backend) == ("fp32", "cpu", "gloo")  # precision auto on CPU
    assert (cpu.engine_plan.zero_stage, cpu.engine, cpu.sequence_parallel) == (cfg.zero.stage, "deepspeed", False)
    gpu = RunPlan.build(cfg, 1, gpu=True)  # a login node planning the GPU run
    assert (gpu.precision, gpu.device, gpu.backend) == ("bf16", "cuda", "nccl")
    assert gpu.dims == cpu.dims and gpu.batch == cpu.batch
    with pytest.raises(dataclasses.FrozenInstanceError):
        cpu.precision = "bf16"  # made once: nothing downstream re-decides it


def test_tp2_pp2_dp2_plan_matches_megatron_rank_order():
    cfg = load_config(None, [*TINY, "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"])
    plan = RunPlan.build(cfg, 8, gpu=True)
    assert plan.dims.names == ("tp", "dp", "pp")  # megatron-core's tp-cp-ep-dp-pp order, tp fastest
    assert (plan.tp, plan.dp, plan.pp, plan.world_size) == (2, 2, 2, 8)
    assert (plan.batch.global_batch, plan.batch.micro_batch, plan.batch.accum, plan.batch.dp) == (8, 2, 2, 2)
    assert (plan.precision, plan.engine_plan.zero_stage, plan.sequence_parallel) == ("bf16", 1, True)
    assert plan.describe() == "8 ranks = tp 2 x pp 2 x dp 2; global batch 8 = micro 2 x accum 2 x dp 2"
    ref = _megatron_ranks(tp=2, dp=2, pp=2)
    for axes in (("tp",), ("dp",), ("pp",), ("tp", "pp")):
        assert plan.dims.group_ranks(*axes) == sorted(ref.get_ranks("-".join(axes))), axes
    for rank in range(8):
        at = plan.dims.coords(rank)
        assert rank == at["tp"] + 2 * (at["dp"] + 2 * at["pp"]) == plan.dims.rank_of(**at)


def test_a_cp_axis_of_size_1_changes_nothing_and_cp_2_is_megatrons_grid():
    without = ParallelDims.of(tp=2, dp=2, pp=2)
    with_cp = ParallelDims.of(pp=2, cp=1, tp=2, dp=2)  # any order given; kept in grid order
    assert with_cp.names == ("tp", "cp", "dp", "pp") and without.cp == 1
    assert with_cp.world_size == without.world_size
    assert all(with_cp.coords(r) == without.coords(r) for r in range(8))
    for axes in (("tp",), ("dp",), ("pp",), ("cp",), ("tp", "pp")):
        assert with_cp.group_ranks(*axes) == without.group_ranks(*axes), axes
    cp2 = ParallelDims.of(tp=2, cp=2, dp=2, pp=2)  # the axis an addition, not a rewrite
    ref = _megatron_ranks(tp=2, dp=2, pp=2, cp=2)
    for axes in (("tp",), ("cp",), ("dp",), ("pp",), ("tp", "pp")):
        assert cp2.group_ranks(*axes) == sorted(ref.get_ranks("-".join(axes))), axes
    assert GRID_ORDER == ("tp", "cp", "ep", "dp", "pp")
    with pytest.raises(ValueError, match="unknown parallel axis sp"):
        ParallelDims.of(sp=2)


@pytest.mark.parametrize("overrides,world,gpu,needle", [
    (["parallel.tp=2", "parallel.pp=2"], 6, False, "not divisible by parallel.tp * parallel.pp = 2*2"),
    (["parallel.pp=2", "zero.stage=2"], 2, False, "zero.stage=2 cannot be combined"),
    (["parallel.pp=2", "zero.stage=0"], 2, False, "zero.stage=0 with parallel.pp=2"),
    (["zero.stage=0"], 1, True, "train.precision=bf16 needs zero.stage >= 1"),  # auto resolved for the GPUs
    (["parallel.tp=8"], 8, False, "n_heads=4 is not divisible by parallel.tp=8"),
    (["parallel.tp=4", "model.n_kv_heads=2"], 4, False, "n_kv_heads=2 is not divisible"),
    (["parallel.tp=4", "model.ffn_hidden=102"], 4, False, "MLP width 102"),
    (["parallel.tp=2", "model.vocab_size=511", "model.code_bits=9"], 2, False, "vocab_size=511"),
    (["parallel.pp=4"], 4, False, "n_layers=2 is fewer than parallel.pp=4"),
    (["parallel.sequence_parallel=true"], 1, False, "needs parallel.tp > 1"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_len=31"], 2, False, "seq_len=31"),
    (["parallel.pp=2", "model.input=learned", "model.tie_embeddings=true"], 2, False, "tie_embeddings"),
    (["parallel.tp=2", "model.dropout=0.1"], 2, False, "dropout=0.1 with parallel.tp=2 would drop"),
    (["parallel.tp=2", "model.fused_first_layer=true"], 2, False, "deepspeed for the plain model only"),
    (["train.global_batch=6"], 4, False, "global_batch=6 is not divisible"),
    (["parallel.backend=nccl"], 1, False, "parallel.backend=nccl needs CUDA GPUs, and the run is planned for CPUs"),
])
def test_each_layout_error_is_raised_by_the_build(overrides, world, gpu, needle):
    cfg = load_config(None, [*TINY, "train.global_batch=4", *overrides], validate=False)
    with pytest.raises(LayoutError) as refused:
        RunPlan.build(cfg, world, gpu=gpu)
    assert needle in str(refused.value)


def test_precision_that_needs_a_gpu_is_refused_for_a_cpu_plan():
    with pytest.raises(ConfigError, match=r"train\.precision=bf16 needs a GPU"):
        RunPlan.build(load_config(None, [*TINY, "train.precision=bf16"]), 1, gpu=False)
    # gloo computes on CPU even on GPU machines, so auto resolves for the CPU there
    plan = RunPlan.build(load_config(None, [*TINY, "parallel.backend=gloo"]), 1, gpu=True)
    assert (plan.device, plan.backend, plan.precision) == ("cpu", "gloo", "fp32")


def test_setup_distributed_takes_only_a_plan_for_this_launch():
    from megafixed.parallel import setup_distributed

    cfg = load_config(None, TINY)
    with pytest.raises(TypeError, match=r"takes a RunPlan .*RunPlan\.for_launch"):
        setup_distributed(cfg)
    with pytest.raises(LayoutError, match="this launch has 1 rank but the run plan was made for 2"):
        setup_distributed(RunPlan.build(cfg, 2, gpu=False))  # refused before any process group


def test_one_megafixed_train_validates_the_layout_once(tmp_path, monkeypatch):
    """The command builds the plan; setup_distributed and the trainer read it (no second check)."""
    from megafixed.commands import train as train_command
    from megafixed.parallel import layout
    from megafixed.train.stop import StopRequest

    calls = []
    real = layout.validate_layout

    def counted(*a, **kw):
        calls.append(a[1])
        return real(*a, **kw)

    monkeypatch.setattr(layout, "validate_layout", counted)
    args = SimpleNamespace(config=None, overrides=[
        *TINY_MODEL, "data.mock=true", f"train.run_dir={tmp_path / 'run'}", "train.max_steps=1",
        "train.global_batch=2", "train.micro_batch=2", "validation.interval=0", "checkpoint.interval=1",
        "metrics.tensorboard=false", "train.precision=fp32"])
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        assert train_command._train(args, StopRequest()) == 0  # `megafixed train`'s body (run() os._exits)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    assert calls == [1]  # once, for the one rank of this launch
    assert (tmp_path / "run" / "checkpoints" / "latest").exists()


def test_a_plan_carries_the_config_it_was_built_from():
    # what runs reads the plan's own config, so a plan and a config cannot disagree (nothing to re-check)
    cfg = load_config(None, TINY)
    plan = RunPlan.build(cfg, 1, gpu=False)
    assert plan.config is cfg and plan.batch.global_batch == cfg.train.global_batch == 8
    other = RunPlan.build(load_config(None, [*TINY, "train.global_batch=16"]), 1, gpu=False)
    assert other.config.train.global_batch == other.batch.global_batch == 16
    assert plan != other and "config" not in repr(plan)  # compared and shown by what it decided
