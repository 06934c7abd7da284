"""The memory planner against measured tensor bytes (CPU, fp32) and the ``megafixed plan`` verb."""
from __future__ import annotations

import json

import pytest
import torch

from megafixed.cli import main as cli_main
from megafixed.config import load_config
from megafixed.model import GPT
from megafixed.parallel.memory import (
    Layout,
    estimate,
    layer_activation_bytes,
    model_state_bytes,
    stage_params,
    tp_param_counts,
)
from megafixed.parallel.tensor import sharded_dim

BASE = ["model.vocab_size=512", "model.d_model=128", "model.n_heads=4", "model.max_seq_len=256",
        "data.seq_len=256", "model.code_bits=9", "model.n_layers=2", "train.seed=3"]
STATE_RTOL = 0.001  # model states: exact accounting (only Adam's scalar step counters are extra)
ACT_RTOL = 0.10  # activations: formula vs the autograd graph (see docs/parallelism.md)


def _cfg(*overrides):
    return load_config(None, [*BASE, *overrides])


@pytest.mark.parametrize("overrides", [["model.input=canonical"], ["model.input=learned"],
                                       ["model.input=learned", "model.mlp=swiglu", "model.bias=true",
                                        "model.norm=layernorm", "model.n_kv_heads=2"]])
def test_param_counts_and_tp_split_match_the_model(overrides):
    cfg = _cfg(*overrides)
    model = GPT(cfg.model)
    c = tp_param_counts(cfg.model)
    assert c.total == sum(p.numel() for p in model.parameters())
    sharded = sum(p.numel() for n, p in model.named_parameters() if sharded_dim(n) is not None)
    assert c.input + c.n_layers * c.block_sharded + c.head_sharded == sharded


@pytest.mark.parametrize("kind", ["canonical", "learned"])
def test_model_state_estimate_matches_measured_fp32_adam_bytes(kind):
    """params + grads + AdamW state after one real step == the fp32 estimate (1 process, no ZeRO)."""
    cfg = _cfg(f"model.input={kind}")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (2, 64))
    model(ids, ids).backward()
    opt.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    measured_params = nbytes(model.parameters())
    measured_grads = nbytes(p.grad for p in model.parameters())
    measured_opt = nbytes(v for st in opt.state.values() for k, v in st.items() if k != "step")
    est = estimate(cfg.model, 64, Layout(zero=0, micro_batch=2), precision="fp32")
    assert est.params == pytest.approx(measured_params, rel=STATE_RTOL)
    assert est.grads == pytest.approx(measured_grads, rel=STATE_RTOL)
    assert est.optimizer == pytest.approx(measured_opt, rel=STATE_RTOL)
    # what the fixed code saves is exactly the table: V * d parameters, 16 bytes each in fp32 Adam
    if kind == "learned":
        fixed = estimate(_cfg("model.input=canonical").model, 64, Layout(zero=0), precision="fp32")
        assert est.params + est.grads + est.optimizer - (fixed.params + fixed.grads + fixed.optimizer) \
            == 512 * 128 * 16


def _saved_activation_bytes(model, ids) -> int:
    """Bytes of the distinct tensors autograd keeps for backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, ids)
    return sum(seen.values())


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_activation_estimate_matches_saved_tensor_bytes(mlp):
    """Per-layer activations (difference of 4- and 2-layer models) and the whole forward, fp32."""
    seq, micro = 256, 4
    ids = torch.randint(0, 512, (micro, seq))
    measured = {}
    for layers in (2, 4):
        cfg = _cfg(f"model.mlp={mlp}", f"model.n_layers={layers}", "model.input=learned")
        torch.manual_seed(0)
        measured[layers] = _saved_activation_bytes(GPT(cfg.model), ids)
    per_layer = (measured[4] - measured[2]) / 2
    assert layer_activation_bytes(cfg.model, seq, micro, 1, False, 4, False) == pytest.approx(per_layer, rel=ACT_RTOL)
    total = estimate(cfg.model, seq, Layout(micro_batch=micro), "fp32", dropout_masks=False).activations
    assert total == pytest.approx(measured[4], rel=ACT_RTOL)


def test_parallel_splits_follow_the_rules():
    m = _cfg("model.input=learned", "model.n_layers=4").model
    c = tp_param_counts(m)
    one = stage_params(m, Layout())[0]
    assert one == c.total
    tp2 = stage_params(m, Layout(tp=2))[0]
    assert tp2 == (c.total - c.n_layers * c.block_replicated - c.head_replicated) // 2 \
        + c.n_layers * c.block_replicated + c.head_replicated
    pp2 = stage_params(m, Layout(pp=2), partition="type:Block")
    assert sum(pp2) == c.total and pp2[0] == c.input + 2 * (c.block_sharded + c.block_replicated)
    base = model_state_bytes(one, Layout(dp=4, zero=0))  # bf16 (params, grads, optimizer)
    z1, z2, z3 = (model_state_bytes(one, Layout(dp=4, zero=z)) for z in (1, 2, 3))
    assert z1[2] == base[2] / 4 and z1[1] == base[1]
    # ZeRO-2 keeps the fp32 partition of the gradients (its 16-bit ones go through the bucket)
    assert z2[1] == one * 4 / 4 and z3[1] == z2[1] and z3[0] == base[0] / 4
    bucketed = estimate(m, 256, Layout(dp=4, zero=2, micro_batch=2, reduce_bucket=1000))
    assert bucketed.grads == z2[1] + 1000 * 2  # the bucket, in the compute dtype
    sp = estimate(m, 256, Layout(tp=2, micro_batch=2, sequence_parallel=True))
    nosp = estimate(m, 256, Layout(tp=2, micro_batch=2))
    assert sp.activations < nosp.activations
    ckpt = estimate(m, 256, Layout(micro_batch=2, activation_checkpointing=True))
    assert ckpt.activations < estimate(m, 256, Layout(micro_batch=2)).activations


def _plan_json(tmp_path, capsys, *args) -> dict:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {vocab_size: 512, d_model: 128, n_heads: 4, n_layers: 4, max_seq_len: 256, "
                   "code_bits: 9}\ndata: {seq_len: 256}\ntrain: {global_batch: 16}\n")
    capsys.readouterr()
    cli_main(["plan", str(cfg), *args, "--json"])
    return json.loads(capsys.readouterr().out)


def test_plan_verb_lists_only_possible_layouts_and_the_fixed_code_saving(tmp_path, capsys):
    out = _plan_json(tmp_path, capsys, "--gpus", "8", "--gpu-mem", "1GB")
    layouts = [row["layout"] for row in out["layouts"]]
    assert layouts and all(lay["tp"] * lay["cp"] * lay["pp"] * lay["dp"] == 8 for lay in layouts)
    assert not any(lay["tp"] == 8 for lay in layouts)  # 4 heads cannot be split 8 ways
    assert not any(lay["tp"] * lay["cp"] > 4 for lay in layouts)  # nor by tp, then Ulysses' cp
    assert any(lay["cp"] > 1 for lay in layouts)
    assert not any(lay["pp"] > 1 and lay["zero"] >= 2 for lay in layouts)
    assert all(row["fits"] == (row["total"] <= out["budget_bytes"]) for row in out["layouts"])
    best = out["layouts"][0]
    saving = out["fixed_code_saving_per_gpu"]
    assert saving["params"] == 512 * 128 // best["layout"]["tp"]
