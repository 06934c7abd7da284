"""The torch-native engine (``train.engine=torch``, megafixed/engine/native/): its config keys and
refusals, its initial weights on any sharding, its bf16 policy, the non-finite contract, and --
through ``megafixed train`` -- the same losses and gradient norms as the single-process DeepSpeed
reference (conftest ``tiny_reference``) for one process, FSDP2 over two ranks and HSDP."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _metrics import assert_matches, read_metrics
from _train_data import reference_overrides
from megafixed.config import Config, ConfigError, load_config
from megafixed.parallel.layout import LayoutError
from megafixed.run_plan import RunPlan

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-5  # the bar: fp32 on CPU, the same operations in another order (sharded reductions)
TINY = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.code_bits=8",
        "model.max_seq_len=32", "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2"]


def _cfg(*overrides: str):
    return load_config(None, [*TINY, *overrides])


# ----------------------------------------------------------------------------------- config, plan
def test_engine_key_and_torch_engine_section():
    assert Config().train.engine == "deepspeed"  # DeepSpeed stays the default
    cfg = _cfg("train.engine=torch", "torch_engine.dp_replicate=2", "torch_engine.reshard_after_forward=false")
    assert (cfg.train.engine, cfg.torch_engine.dp_replicate, cfg.torch_engine.reshard_after_forward) == \
        ("torch", 2, False)
    with pytest.raises(ConfigError, match=r"train\.engine='jax' is not one of \['deepspeed', 'torch'\]"):
        _cfg("train.engine=jax")
    with pytest.raises(ConfigError, match=r"torch_engine\.dp_replicate=0 must be >= 1"):
        _cfg("torch_engine.dp_replicate=0")
    with pytest.raises(ConfigError, match=r"unknown config key 'torch_engine\.shard'.*dp_replicate"):
        _cfg("torch_engine.shard=2")


def test_plan_names_its_engine_and_is_bound_to_it():
    plan = RunPlan.build(_cfg("train.engine=torch", "torch_engine.dp_replicate=2"), 4, gpu=False)
    assert (plan.engine, plan.dp, plan.engine_plan.dp_replicate) == ("torch", 4, 2)
    assert RunPlan.build(_cfg("torch_engine.dp_replicate=2"), 4, gpu=False).engine == "deepspeed"
    assert plan.config.train.engine == "torch" and plan.config.torch_engine.dp_replicate == 2  # what runs reads


@pytest.mark.parametrize("overrides,world,gpu,needle", [
    # parallel.pp > 1 runs (torch.distributed.pipelining); its own refusals: tests/test_native_pipeline.py
    (["parallel.pp=2", "parallel.vpp=2"], 2, False, "parallel.pp_schedule=1F1B runs one stage per rank, but "
                                                    "parallel.vpp=2; set parallel.vpp=1"),
    (["train.precision=fp16"], 1, True, "train.precision=fp16 is not supported by train.engine=torch"),
    (["torch_engine.dp_replicate=3"], 2, False, "torch_engine.dp_replicate=3 does not divide the data-parallel "
                                                "size 2"),
    (["zero.offload_optimizer=true"], 1, False, "zero.offload_optimizer=true is a DeepSpeed option"),
])
def test_what_the_torch_engine_refuses_by_name(overrides, world, gpu, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        RunPlan.build(_cfg("train.engine=torch", *overrides), world, gpu=gpu)


def test_zero_rules_hold_only_for_deepspeed():
    # bf16 without ZeRO: DeepSpeed accumulates in 16 bits there, so it is refused; FSDP2 keeps fp32
    # gradients (MixedPrecisionPolicy reduce_dtype), so the torch engine takes the same config.
    with pytest.raises(LayoutError, match=r"train\.precision=bf16 needs zero\.stage >= 1"):
        RunPlan.build(_cfg("zero.stage=0"), 1, gpu=True)
    assert RunPlan.build(_cfg("zero.stage=0", "train.engine=torch"), 1, gpu=True).precision == "bf16"


# ----------------------------------------------------------------------------------- initial weights
@pytest.mark.parametrize("extra", [["model.input=canonical"], ["model.input=learned", "model.tie_embeddings=true"]])
def test_materialize_gives_the_single_process_weights(extra):
    from megafixed.engine.native.materialize import materialize
    from megafixed.model.gpt import GPT, meta_gpt

    cfg = _cfg(*extra)
    ref = GPT(cfg.model, seed=11)
    model = meta_gpt(cfg.model)
    materialize(model, cfg.model, 11, torch.device("cpu"))
    got = dict(model.named_parameters())
    assert set(got) == set(dict(ref.named_parameters()))
    for name, p in ref.named_parameters():
        assert not got[name].is_meta and torch.equal(got[name], p), name
    for name, b in ref.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], b), name  # the fixed code's buffers
    if cfg.model.tie_embeddings:
        assert model.head.proj.weight is model.input.get_parameter(model.interface.table)


# One fake-backend rank (no communication at all) of an 8-rank world: the meta GPT gets TP (Colwise q,
# Rowwise o) and FSDP2 as build.py applies it, on build_mesh's mesh; every local shard must be exactly
# the matching slice of the single-process weights, computed here by plain chunking.
SHARDS_WORKER = r"""
import sys
from types import SimpleNamespace
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from megafixed.config import load_config
from megafixed.model.gpt import GPT, meta_gpt
from megafixed.engine.native.build import apply_fsdp, build_model
from megafixed.engine.native.materialize import materialize
from megafixed.engine.native.mesh import build_mesh, dp_submesh

rank = int(sys.argv[1])
cfg = load_config(None, sys.argv[2:])
ref = GPT(cfg.model, seed=cfg.train.seed).state_dict()
dist.init_process_group("fake", rank=rank, world_size=8, store=FakeStore())
for rep, shard, tp, precision in ((2, 2, 2, "fp32"), (4, 2, 1, "bf16")):
    mesh = build_mesh(SimpleNamespace(dp=rep * shard, tp=tp, pp=1, device="cpu"), rep)
    r, s, t = mesh.get_coordinate()
    assert rank == t + tp * (r * shard + s), ("rank order", rank, (r, s, t))
    assert dp_submesh(mesh).get_local_rank() == r * shard + s and dp_submesh(mesh).size() == rep * shard
    if tp > 1:
        model = meta_gpt(cfg.model)
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"attn.wq": ColwiseParallel(), "attn.wo": RowwiseParallel()})
        apply_fsdp(model, mesh, precision=precision, reshard_after_forward=True)
        materialize(model, cfg.model, cfg.train.seed, torch.device("cpu"))
    else:  # build.py's own path, for a plan that asks for bf16 (a GPU plan: this CPU cannot run one)
        plan = SimpleNamespace(tp=1, cp=1, dp=rep * shard, precision=precision, sequence_parallel=False)
        cfg.train.compile = cfg.train.activation_checkpointing = True
        model = build_model(cfg, SimpleNamespace(plan=plan, mesh=mesh, device=torch.device("cpu"), init_device=None))
        for m in (*model.blocks, model.head, model):
            policy = m._get_fsdp_state()._mp_policy
            assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32), policy
        assert model.blocks[0].attn.wq.weight.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
        from megafixed.engine.native.step import compute_context
        import contextlib
        assert compute_context(model, "bf16", "cpu") is contextlib.nullcontext  # FSDP2 casts, no autocast
        # train.compile: each block compiled in place (names unchanged), then sharded; checkpointed by GPT.forward
        assert all(b._compiled_call_impl is not None for b in model.blocks) and model.activation_checkpointing
    for name, p in model.named_parameters():
        full = ref[name]
        if tp > 1 and ".attn.wq." in name:
            full = full.chunk(tp, 0)[t]
        if tp > 1 and name.endswith("attn.wo.weight"):
            full = full.chunk(tp, 1)[t]
        assert p.dtype == torch.float32, (name, p.dtype)  # fp32 master weights under any policy
        assert torch.equal(p.to_local(), full.chunk(shard, 0)[s]), (rank, (r, s, t), name, p.placements)
print("ok", rank)
"""


@pytest.mark.multiprocess
def test_materialize_slices_every_placement_like_the_single_process_weights():
    overrides = [*TINY, "model.input=learned", "train.seed=7"]
    cmd = [sys.executable, "-c", SHARDS_WORKER]
    # Ranks 1 and 6 sit at different coordinates on every mesh dimension (0/1 mixed), so a swapped
    # axis or a wrong chunk shows; one process each (a process holds one fake rank).
    procs = [subprocess.Popen([*cmd, str(rank), *overrides], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (1, 6)]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "ok" in out, out[-3000:]


def test_precision_policies():
    from megafixed.engine.native.build import mixed_precision_policy
    from megafixed.engine.native.step import compute_context
    from megafixed.model.gpt import GPT

    fp32 = mixed_precision_policy("fp32")
    assert (fp32.param_dtype, fp32.reduce_dtype) == (None, None)
    bf16 = mixed_precision_policy("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    # one data-parallel rank has no FSDP2 to cast: bf16 is autocast over the fp32 weights there
    model = GPT(_cfg("model.input=canonical").model)
    ids = torch.randint(0, 256, (1, 8))
    with compute_context(model, "bf16", "cpu")():
        assert model(ids).dtype == torch.bfloat16
    with compute_context(model, "fp32", "cpu")():
        assert model(ids).dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())


# ----------------------------------------------------------------------------------- one process
# A fresh process: the torch engine's build and steps import neither DeepSpeed nor megatron-core, and
# keep the non-finite contract (stop: the named error; skip: no update, no optimizer state).
NONFINITE_WORKER = r"""
import math, sys
import torch
from megafixed.config import load_config
from megafixed.engine import Engine, NonFiniteLossError, build_engine
from megafixed.parallel import setup_distributed
from megafixed.run_plan import RunPlan

cfg = load_config(None, sys.argv[1:])
engine = build_engine(cfg, setup_distributed(RunPlan.for_launch(cfg)))
assert engine.name == "torch" and isinstance(engine, Engine)  # the seam's protocol, all of it
data = torch.randint(0, cfg.model.vocab_size, (64, cfg.data.seq_len + 1), generator=torch.Generator().manual_seed(0))
batches = iter(data.split(cfg.train.micro_batch))
first = engine.train_step(batches, 1e-3, 1)  # steps numbered as in the logs
assert not first.skipped and math.isfinite(first.loss) and first.grad_norm > 0
with torch.no_grad():
    engine.module.head.proj.weight[3, 5] = float("nan")  # every loss is NaN from here on
before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in engine.optimizer.state.items()}
engine.cfg.guard.on_nonfinite = "skip"
skipped = engine.train_step(batches, 1e-3, 2)
assert skipped.skipped and math.isnan(skipped.loss) and skipped.grad_norm is None
for n, p in engine.module.named_parameters():
    assert torch.equal(p.detach().nan_to_num(7.0), before[n].nan_to_num(7.0)), n
    assert p.grad is None, n
for p, s in engine.optimizer.state.items():
    assert all(torch.equal(v, moments[id(p)][k]) for k, v in s.items())
engine.cfg.guard.on_nonfinite = "stop"
try:
    engine.train_step(batches, 1e-3, 3)
    raise AssertionError("a non-finite loss did not stop")
except NonFiniteLossError as exc:
    assert "step 3: the training loss is nan" in str(exc) and "on_nonfinite=skip" in str(exc), exc
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("deepspeed", "megatron"))
assert not heavy, heavy[:5]
print("ok")
"""


def test_nonfinite_contract_and_no_deepspeed_or_megatron():
    from _env import launch_free_env

    proc = subprocess.run([sys.executable, "-c", NONFINITE_WORKER, *TINY, "train.engine=torch", "model.input=learned"],
                          cwd=ROOT, env=launch_free_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]


# ----------------------------------------------------------------------------------- through `megafixed train`
def _train(nproc, shards, run_dir, kind, *extra, torchrun=None):
    overrides = reference_overrides(shards, run_dir, kind, "train.engine=torch", *extra)
    args = ["-m", "megafixed.cli", "train", "/dev/null", *overrides]
    if nproc > 1:
        torchrun(nproc, args)
        return
    from _env import launch_free_env

    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=launch_free_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


# Validation every 2 steps in the torch runs below (the reference has none; it consumes no training
# data or RNG, so the training numbers still match): the sharded runs' val_loss must equal one process's.
WITH_VALIDATION = ("validation.interval=2",)


@pytest.fixture(scope="module")
def one_process(tiny_shards, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("native_one") / "run"
    _train(1, tiny_shards, run_dir, "canonical", *WITH_VALIDATION)
    return run_dir


def _validation(run_dir) -> dict:
    return {r["step"]: r["val_loss"] for r in read_metrics(run_dir, "val_loss")}


def _assert_same_validation(run_dir, one_dir, what):
    got, want = _validation(run_dir), _validation(one_dir)
    assert sorted(got) == sorted(want) == [0, 2, 4], what
    for step in want:
        assert math.isclose(got[step], want[step], rel_tol=RTOL), \
            f"{what}: step {step} val_loss {got[step]} vs {want[step]}"


@pytest.mark.multiprocess
def test_one_process_equals_the_deepspeed_reference(one_process, tiny_reference):
    assert_matches(one_process, tiny_reference("canonical")["canonical"], "torch engine, 1 process")


@pytest.mark.multiprocess
def test_fsdp2_over_two_ranks_equals_the_reference(tiny_shards, tiny_reference, torchrun, tmp_path, one_process):
    # FSDP2 per block and head, each block checkpointed (activation checkpointing composed with it);
    # its evaluation (sharded, no grad) gives the one-process validation losses.
    ref = tiny_reference("canonical")["canonical"]
    _train(2, tiny_shards, tmp_path / "run", "canonical", "train.activation_checkpointing=true", *WITH_VALIDATION,
           torchrun=torchrun)
    assert_matches(tmp_path / "run", ref, "torch engine, FSDP2 dp=2")
    _assert_same_validation(tmp_path / "run", one_process, "torch engine, FSDP2 dp=2")


@pytest.mark.multiprocess
def test_hsdp_replication_over_two_ranks_equals_the_reference(tiny_shards, tiny_reference, torchrun, tmp_path):
    # dp_replicate=2 on 2 ranks: a (2, 1) mesh, i.e. plain replication (all-reduced gradients), with the
    # learned table and the parameters kept gathered between forward and backward.
    ref = tiny_reference("learned")["learned"]
    _train(2, tiny_shards, tmp_path / "run", "learned", "torch_engine.dp_replicate=2",
           "torch_engine.reshard_after_forward=false", torchrun=torchrun)
    assert_matches(tmp_path / "run", ref, "torch engine, HSDP 2x1")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_compiled_blocks_under_fsdp2_and_checkpointing_train_like_eager(tiny_shards, tiny_reference, torchrun,
                                                                       tmp_path):
    # train.compile=true per block composed with FSDP2 and activation checkpointing. Inductor compiles
    # for minutes on a loaded 2-core CPU (about 4 min measured for one process), so this is a slow test
    # of two steps (decay_steps keeps the reference's learning rates). Its kernels fuse and reassociate
    # fp32 reductions (norms, softmax, matmul epilogues; SIMD width per CPU), so the run is not bitwise
    # eager: measured 4e-8 relative on the loss; 1e-4 leaves room for other CPUs' vector widths.
    ref = tiny_reference("canonical")["canonical"]
    _train(2, tiny_shards, tmp_path / "run", "canonical", "train.compile=true", "train.activation_checkpointing=true",
           "train.max_steps=2", "schedule.decay_steps=4", torchrun=torchrun)
    assert_matches(tmp_path / "run", ref, "torch engine, compiled blocks", steps=2, rtol=1e-4)
