"""The logic of CUDA-only paths that a reading found wrong, each checked on CPU (docs/gpu.md lists them all):

* the torch engine's pipeline at dp 1 in bf16: each stage sends what its neighbour was told to expect
  (the learned input's residual stream stays fp32 under autocast; the codes' is bf16);
* ``parallel.backend=gloo`` on a GPU host keeps DeepSpeed on CPU and never opens a CUDA context for
  the RNG state;
* megatron-core's groups get ``parallel.collective_timeout_s`` (not its own 30 minutes);
* ``bench kernels --device cuda:N`` makes N the current device; auto precision asks whether the GPU
  has bf16; a local rank without a GPU is a named error; NCCL gets the rank's ``device_id``;
* ``--gpu-mem``: GB is 10^9 bytes, GiB 2^30; the GPU check's summary keeps every engine's training row;
* the fused residual add refuses a ``y`` whose tokens are not the ids' (it would write out of bounds).
"""
from __future__ import annotations

import json
import os
import types

import pytest
import torch

from megafixed.config import load_config
from megafixed.run_plan import RunPlan

TINY = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.code_bits=8",
        "model.max_seq_len=32", "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2",
        "train.engine=torch"]


# ----------------------------------------------------------------------------------- 1: pipeline dtypes
@pytest.mark.parametrize("kind", ["learned", "canonical", "gf2"])
@pytest.mark.parametrize("fused", [False, True])
def test_pipeline_stages_send_the_dtype_their_neighbour_expects_at_dp1_bf16(kind, fused):
    """bf16 autocast runs on CPU: the stage modules of a PP2 x DP1 plan, under the engine's own compute
    context, against the meta tensors ``PipelineStage`` is given (NCCL would move the wrong bytes)."""
    if kind == "learned" and fused:
        pytest.skip("the fused first layer folds a fixed code")
    from megafixed.engine.native.pipeline import StageModule, _activation_meta, set_input_dtype
    from megafixed.engine.native.schedules import stage_spans
    from megafixed.engine.native.step import compute_context
    from megafixed.model.gpt import GPT

    cfg = load_config(None, [*TINY, f"model.input={kind}", f"model.fused_first_layer={str(fused).lower()}",
                             "parallel.pp=2", "train.precision=bf16"])
    plan = RunPlan.build(cfg, 2, gpu=True)
    assert (plan.dp, plan.pp, plan.precision) == (1, 2, "bf16")
    spans = stage_spans(cfg.model.n_layers, 2, plan.engine_plan.pp_input_head_layers)
    torch.manual_seed(0)
    gpt = GPT(cfg.model)
    set_input_dtype(gpt, plan)  # as build_stages does
    first, last = (StageModule(gpt, s) for s in spans)
    ids = torch.randint(0, cfg.model.vocab_size, (plan.batch.micro_batch, plan.batch.seq_len))
    with compute_context(first, plan.precision, "cpu")():
        hidden = first(ids)
        logits = last(hidden)
    sent = _activation_meta(cfg, plan, spans[0], output=True)
    expected = _activation_meta(cfg, plan, spans[1], output=False)
    assert (hidden.dtype, tuple(hidden.shape)) == (sent.dtype, tuple(sent.shape)) == (expected.dtype,
                                                                                      tuple(expected.shape))
    assert hidden.dtype == (torch.float32 if kind == "learned" else torch.bfloat16)
    out = _activation_meta(cfg, plan, spans[1], output=True)
    assert (logits.dtype, tuple(logits.shape)) == (out.dtype, tuple(out.shape))


def test_under_fsdp_the_hidden_states_are_the_compute_dtype():
    from megafixed.engine.native.pipeline import hidden_dtype

    for kind in ("learned", "canonical"):
        cfg = load_config(None, [*TINY, f"model.input={kind}", "parallel.pp=2", "train.precision=bf16"])
        assert hidden_dtype(cfg, RunPlan.build(cfg, 4, gpu=True)) == torch.bfloat16  # dp 2: FSDP2 casts
        cfg = load_config(None, [*TINY, f"model.input={kind}", "parallel.pp=2"])
        assert hidden_dtype(cfg, RunPlan.build(cfg, 2, gpu=False)) == torch.float32


# ----------------------------------------------------------------------------------- 2: gloo on a GPU host
def test_gloo_on_a_gpu_host_keeps_deepspeed_on_cpu(monkeypatch):
    from megafixed.engine import prepare_runtime_env

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for backend, want in (("gloo", "cpu"), ("nccl", None), (None, None)):
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
        prepare_runtime_env("deepspeed", backend)
        assert os.environ.get("DS_ACCELERATOR") == want, backend


def test_rng_state_opens_no_cuda_context_where_the_run_computes_on_cpu(monkeypatch):
    from megafixed.train import checkpoint

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("asked CUDA for its device"))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a: pytest.fail("read a CUDA RNG state"))
    state = checkpoint.rng_state()
    assert "cuda" not in state and torch.equal(state["torch"], torch.get_rng_state())


# ----------------------------------------------------------------------------------- 3: collective timeouts
def test_megatron_groups_get_the_runs_collective_timeout(monkeypatch):
    from megafixed.engine.deepspeed import groups, megatron_tp

    calls = {}

    class FakeParallelState:
        @staticmethod
        def model_parallel_is_initialized():
            return False

        @staticmethod
        def initialize_model_parallel(**kwargs):
            calls.update(kwargs)

        get_tensor_model_parallel_group = get_data_parallel_group = get_model_parallel_group = staticmethod(
            lambda: None)

    monkeypatch.setattr(megatron_tp, "load", lambda: types.SimpleNamespace(parallel_state=FakeParallelState))
    plan = types.SimpleNamespace(tp=2, pp=1, collective_timeout_s=90.0)
    groups.megatron_groups(plan)
    assert calls["distributed_timeout_minutes"] == 1.5
    # megatron makes a timedelta of it: 90 s, not its default 30 minutes
    from datetime import timedelta
    assert timedelta(minutes=calls["distributed_timeout_minutes"]) == timedelta(seconds=90)


# ----------------------------------------------------------------------------------- 6, 7
def test_bench_kernels_makes_the_named_gpu_current(monkeypatch):
    from megafixed.bench import kernels

    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
    kernels.select_device(torch.device("cuda", 1))
    kernels.select_device(torch.device("cpu"))
    assert chosen == [torch.device("cuda", 1)]


def test_auto_precision_is_fp32_on_a_gpu_without_bf16(monkeypatch):
    from megafixed.run_plan import resolve_precision

    cfg = load_config(None, [*TINY])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert resolve_precision(cfg) == "fp32"
    assert resolve_precision(cfg, gpu=True) == "bf16"  # planned for other machines: assumed to have it
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_precision(cfg) == "bf16"


def test_a_local_rank_without_a_gpu_is_a_named_error():
    from megafixed.parallel.layout import LayoutError
    from megafixed.parallel.topology import check_local_rank

    check_local_rank(1, 2)
    with pytest.raises(LayoutError, match=r"local rank 2 needs GPU 2, but this node shows 2 .*start at most 2 ranks"):
        check_local_rank(2, 2)


def test_nccl_init_gets_the_ranks_device(monkeypatch):
    from megafixed.launch import rendezvous
    from megafixed.launch.world import World

    seen = {}
    monkeypatch.setattr(rendezvous, "meet", lambda *a: types.SimpleNamespace(set_timeout=lambda t: None))
    monkeypatch.setattr(rendezvous, "signals_end_the_rendezvous", lambda *a: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(torch.distributed, "PrefixStore", lambda prefix, store: store)
    from megafixed.launch import warnings_once
    monkeypatch.setattr(warnings_once, "install", lambda *a: None)
    monkeypatch.setattr(warnings_once, "attach", lambda *a: None)
    world = World(size=1, rank=0, local_rank=0, source="single")
    rendezvous.init_process_group(world, "nccl", 60, device_id=torch.device("cuda", 0))
    assert seen["device_id"] == torch.device("cuda", 0) and seen["backend"] == "nccl"


@pytest.mark.parametrize("text,nbytes", [("80GB", 80e9), ("80GiB", 80 * 2 ** 30), ("24G", 24e9), ("512MiB", 2 ** 29),
                                         ("1.5TB", 1.5e12), ("100B", 100.0), ("2", 2e9)])
def test_gpu_mem_units(text, nbytes):
    from megafixed.plan.rows import parse_bytes

    assert parse_bytes(text) == nbytes


def test_the_gpu_check_summary_keeps_every_engines_training_row(tmp_path):
    from megafixed.bench.gpu_report import report

    row = {"step_s_median": 0.1, "tokens_per_s": 1000.0, "mfu": 0.4, "peak_memory_bytes": 2 ** 30, "overhead": 0.05}
    train = {"bench": "train", "input": "canonical", "tokens_per_step": 4096, "engines": ["deepspeed", "torch"],
             "bare": {**row, "overhead": None}, "deepspeed": row, "torch": {**row, "step_s_median": 0.2},
             "framework": row, "overhead": 0.05}
    (tmp_path / "train_canonical.json").write_text(json.dumps(train))
    report(tmp_path)
    md = (tmp_path / "gpu_check.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| train_canonical |")]
    assert [r.split("|")[4].strip() for r in rows] == ["bare", "deepspeed", "torch"]
    assert "| 200.0 |" in rows[2]


def test_the_fused_residual_add_refuses_a_y_of_other_tokens():
    pytest.importorskip("triton")
    from megafixed.codes import make_code
    from megafixed.kernels.fused_first_layer import add_code_kernel

    code = make_code("gf2", 8, seed=0)
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"add_code: y has shape \(2, 4, 16\) but the ids \(2, 5\) need"):
        add_code_kernel(torch.zeros(2, 4, 16), ids, code)
    # the torch path refuses the same shapes
    with pytest.raises(RuntimeError):
        code.encode(ids, 16) + torch.zeros(2, 4, 16)
