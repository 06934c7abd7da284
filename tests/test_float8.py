"""``train.float8`` (megafixed/engine/native/float8.py): torchao's float8 Linears on the torch engine,
emulated on CPU. Which Linears convert; checkpoints keep their keys and values; the refusals; and,
through ``megafixed train``: the loss after 20 steps within float8's tolerance of the same seed's
run without it, FSDP2 over two ranks equal to one process, and resumes across the switch both ways.

CPU runs train in fp32 (bf16 needs a GPU here): the reference is the fp32 run without float8, which
plays the part the bf16 run plays on a GPU.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _metrics import read_metrics
from _train_data import tiny_overrides
from megafixed.config import ConfigError, load_config
from megafixed.parallel.layout import LayoutError
from megafixed.run_plan import RunPlan

pytest.importorskip("torchao")

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.code_bits=8",
        "model.max_seq_len=32", "data.seq_len=32", "train.global_batch=8", "train.micro_batch=4"]
# |loss(float8) - loss(off)| / loss(off) at step 20 of this tiny model (fp32, seed-for-seed), measured
# before choosing: tensorwise 4.9e-5, 7.1e-5, 2.3e-5 and rowwise 6.1e-5, 2.5e-5, 1.3e-5 for seeds 1, 2, 3,
# where the loss itself moves 7.4e-3 from seed to seed. 5e-4 is 7x the largest float8 gap and 15x below
# the seed spread: a run that trained another model (a lost update, a wrong scale) falls outside it.
FLOAT8_RTOL = 5e-4
DP_RTOL = 1e-5  # the bar: the same fp32 arithmetic, sharded reductions in another order


def _cfg(*overrides: str):
    return load_config(None, [*TINY, *overrides])


# ----------------------------------------------------------------------------------- which Linears
def test_the_blocks_linears_convert_not_the_head_input_or_odd_dims():
    from megafixed.engine.native.float8 import float8_layers
    from megafixed.model.gpt import meta_gpt

    layers = float8_layers(meta_gpt(_cfg().model))
    per_block = ["attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_in", "mlp.w_out"]
    assert layers.converted == tuple(f"blocks.{i}.{n}" for i in range(2) for n in per_block)
    assert layers.kept == ()
    # d_model 72: every attention and MLP matrix has a dim 16 does not divide: torchao's rule keeps them
    odd = float8_layers(meta_gpt(_cfg("model.d_model=72", "model.ffn_hidden=96").model))
    assert odd.converted == () and len(odd.kept) == 12
    assert odd.kept[0] == ("blocks.0.attn.wq", "72x72 not divisible by 16")
    # the fused first layer reads block 0's q/k/v weights itself: they stay plain Linears
    fused = float8_layers(meta_gpt(_cfg("model.fused_first_layer=true").model))
    assert [p for p, _ in fused.kept] == ["blocks.0.attn.wq", "blocks.0.attn.wk", "blocks.0.attn.wv"]
    assert "blocks.0.attn.wo" in fused.converted


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_conversion_keeps_state_dict_keys_and_values_both_ways(recipe):
    from torchao.float8.float8_linear import Float8Linear

    from megafixed.engine.native.float8 import convert_to_float8
    from megafixed.model.gpt import GPT

    cfg = _cfg().model
    torch.manual_seed(0)
    plain = GPT(cfg)
    converted = GPT(cfg)
    convert_to_float8(converted, recipe, emulate=True, fsdp_all_gather=False)
    assert isinstance(converted.blocks[1].mlp.w_out, Float8Linear)
    assert not isinstance(converted.head.proj, Float8Linear)
    converted.load_state_dict(plain.state_dict())  # plain -> float8: strict, same keys
    want = plain.state_dict()
    got = converted.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    plain2 = GPT(cfg)
    plain2.load_state_dict(got)  # float8 -> plain
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    with torch.no_grad():
        a, b = plain(ids, targets=ids).item(), converted(ids, targets=ids).item()
    assert a == plain2(ids, targets=ids).item()
    # float8 rounding of inputs and weights (e4m3: 3 mantissa bits) moves the loss, but little
    assert a != b and math.isclose(a, b, rel_tol=1e-3), (a, b)


# ----------------------------------------------------------------------------------- refusals, plan, memory
@pytest.mark.parametrize("overrides,world,needle", [
    (["train.float8=tensorwise"], 1, "train.float8=tensorwise is not supported by train.engine=deepspeed; set "
                                     "train.engine=torch, or train.float8=off"),
])
def test_what_float8_refuses_by_name(overrides, world, needle):
    with pytest.raises((ConfigError, LayoutError), match=needle.replace(".", r"\.").replace("(", r"\(")
                       .replace(")", r"\)")):
        RunPlan.build(_cfg(*overrides), world, gpu=False)


def test_config_key_and_yaml_off(tmp_path):
    assert _cfg().train.float8 == "off"
    (tmp_path / "c.yaml").write_text("train:\n  float8: off\n")  # YAML 1.1 reads a bare off as false
    assert load_config(str(tmp_path / "c.yaml"), []).train.float8 == "off"
    with pytest.raises(ConfigError, match=r"train\.float8='fp8' is not one of \['off', 'tensorwise', 'rowwise'\]"):
        _cfg("train.float8=fp8")


def test_plan_words_record_and_memory_model():
    from megafixed.engine.native.config import engine_config
    from megafixed.engines import engine_kind
    from megafixed.parallel.memory import estimate

    cfg = _cfg("train.engine=torch", "train.float8=tensorwise", "train.global_batch=16")
    gpu = RunPlan.build(cfg, 4, gpu=True)
    kind = engine_kind("torch")
    assert gpu.engine_plan.start_words == "torch engine, FSDP2 over dp 4, float8 tensorwise"
    assert RunPlan.build(cfg, 1, gpu=False).engine_plan.start_words == "torch engine, float8 tensorwise (emulated)"
    assert engine_config(cfg, gpu)["float8"]["fsdp_float8_all_gather"] is True
    assert engine_config(cfg, RunPlan.build(cfg, 1, gpu=True))["float8"]["fsdp_float8_all_gather"] is False
    assert engine_config(_cfg("train.engine=torch", "train.float8=rowwise"), gpu)["float8"] == {
        "recipe": "rowwise", "by": "torchao convert_to_float8_training (the blocks' Linears)", "emulate": False,
        "fsdp_float8_all_gather": False}  # torchao gathers float8 for tensorwise scales only
    [line] = kind.dry_run_lines(cfg, gpu)
    assert line == ("# float8 tensorwise: 12 Linears, torch._scaled_mm, float8 all-gather; "
                    "head and input in high precision")
    # the gathered blocks' matrices: 1 byte instead of bf16's 2, per gathered block (2: reshard after forward)
    from megafixed.engine.native.planner import make_layout
    from megafixed.parallel.memory import tp_param_counts

    lay = {r: make_layout(_cfg("train.engine=torch", f"train.float8={r}", "train.global_batch=16"),
                          1, 1, 4, 1, 4, False, "parameters") for r in ("off", "tensorwise", "rowwise")}
    est = {r: estimate(cfg.model, 32, lay[r], "bf16") for r in lay}
    assert est["off"].params - est["tensorwise"].params == 2 * tp_param_counts(cfg.model).block_sharded
    assert est["rowwise"].params == est["off"].params


def test_cli_refusal_is_one_line_and_dry_run_names_float8():
    from _env import launch_free_env

    base = [sys.executable, "-m", "megafixed.cli", "train", "/dev/null", *TINY, "--dry-run"]
    proc = subprocess.run([*base, "train.float8=rowwise"], cwd=ROOT, env=launch_free_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "train.float8=rowwise is not supported by train.engine=deepspeed" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run([*base, "train.float8=rowwise", "train.engine=torch"], cwd=ROOT, env=launch_free_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# float8 rowwise: 12 Linears" in proc.stdout and ", float8 rowwise. Nothing was started" in proc.stdout


# ----------------------------------------------------------------------------------- through `megafixed train`
def _train(shards, run_dir, *extra, torchrun=None) -> str:
    overrides = tiny_overrides(shards, run_dir, "model.input=canonical", "train.engine=torch", "train.seed=1",
                               "validation.interval=0", "checkpoint.interval=10",
                               "schedule.decay_steps=20", *extra)  # the 20-step schedule, whatever max_steps
    args = ["-m", "megafixed.cli", "train", "/dev/null", *overrides]
    if torchrun is not None:
        return torchrun(2, args).stdout
    from _env import launch_free_env

    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=launch_free_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def _losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "loss")}


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory):
    """Ten steps without float8 and ten with it, each resumed for ten more both with and without it:
    ``{(first, then): run_dir}``."""
    root = tmp_path_factory.mktemp("float8")
    out = {}
    for first in ("off", "tensorwise"):
        _train(tiny_shards, root / first, f"train.float8={first}", "train.max_steps=10")
        for then in ("off", "tensorwise"):
            run_dir = root / f"{first}_{then}"
            shutil.copytree(root / first, run_dir)
            out[(first, then)] = (run_dir, _train(tiny_shards, run_dir, f"train.float8={then}", "train.max_steps=20"))
    return out


@pytest.mark.multiprocess
def test_float8_loss_within_tolerance_of_the_run_without(runs):
    off, f8 = _losses(runs[("off", "off")][0]), _losses(runs[("tensorwise", "tensorwise")][0])
    assert sorted(off) == sorted(f8) == list(range(1, 21))
    assert "float8 tensorwise (emulated)" in runs[("tensorwise", "tensorwise")][1]
    assert off[20] != f8[20]  # float8 did run
    assert math.isclose(f8[20], off[20], rel_tol=FLOAT8_RTOL), (f8[20], off[20])
    assert f8[20] < f8[1] - 0.5  # and trained


@pytest.mark.multiprocess
def test_resume_across_the_switch_both_ways(runs):
    # the same weights (step 10's checkpoint) computed with and without float8: step 11 of a resumed run
    # is within float8's rounding of the uninterrupted run's step 11; a lost or mangled load would not be
    for first, then in (("off", "tensorwise"), ("tensorwise", "off")):
        run_dir, out = runs[(first, then)]
        got, same = _losses(run_dir), _losses(runs[(first, first)][0])
        assert "resum" in out.lower(), out[-2000:]
        assert sorted(got) == list(range(1, 21)), f"{first} -> {then}"
        assert math.isclose(got[11], same[11], rel_tol=FLOAT8_RTOL), (first, then, got[11], same[11])
        assert math.isclose(got[20], same[20], rel_tol=FLOAT8_RTOL), (first, then, got[20], same[20])
    record = json.loads((runs[("off", "tensorwise")][0] / "torch_engine.json").read_text())
    assert record["float8"]["recipe"] == "tensorwise"


@pytest.mark.multiprocess
def test_fsdp2_over_two_ranks_equals_one_process(runs, tiny_shards, torchrun, tmp_path):
    # FSDP2 all-gathers the tensorwise weights in float8 (one uint8 buffer per block over gloo) with the
    # amax precompute; ten steps, a save, a resume into those float8 weights (whose scales the load
    # precomputes: without it step 11 was 6e-6 off), ten more
    out = _train(tiny_shards, tmp_path / "run", "train.float8=tensorwise", "train.max_steps=10", torchrun=torchrun)
    assert "FSDP2 over dp 2, float8 tensorwise (emulated)" in out
    record = json.loads((tmp_path / "run" / "torch_engine.json").read_text())
    assert record["float8"]["fsdp_float8_all_gather"] is True
    _train(tiny_shards, tmp_path / "run", "train.float8=tensorwise", "train.max_steps=20", torchrun=torchrun)
    got, want = _losses(tmp_path / "run"), _losses(runs[("tensorwise", "tensorwise")][0])
    assert sorted(got) == sorted(want) == list(range(1, 21))
    for step in want:
        assert math.isclose(got[step], want[step], rel_tol=DP_RTOL), (step, got[step], want[step])


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["parallel.pp=2", "parallel.tp=2"])
def test_pipeline_and_tensor_parallel_runs_equal_one_process(layout, runs, tiny_shards, torchrun, tmp_path):
    # pp=2: pipeline.build_stages converts each stage's blocks (its own path, not build_model's);
    # tp=2: DTensor's TP styles over Float8Linear, whose scales are taken over the whole DTensors
    out = _train(tiny_shards, tmp_path / "run", "train.float8=tensorwise", "train.max_steps=3", layout,
                 torchrun=torchrun)
    assert f"{layout.split('=')[0][-2:]} 2" in out and "float8 tensorwise (emulated)" in out
    got, want = _losses(tmp_path / "run"), _losses(runs[("tensorwise", "tensorwise")][0])
    assert sorted(got) == [1, 2, 3]
    for step in got:
        assert math.isclose(got[step], want[step], rel_tol=DP_RTOL), (step, got[step], want[step])
