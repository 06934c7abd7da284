"""The fused first layer (``model.fused_first_layer``) against the unfused model.

* the algebra: RMSNorm of a +-s code is ``alpha * sign * gamma``; ``tile(c) @ W.T = c @ fold(W).T``;
* the model, fp32 on CPU (the torch fold path): logits, loss and the gradient of every parameter
  (the first block's norm and q/k/v weights included) match the unfused model; checkpoints load
  across the switch; configs and layouts it cannot serve are refused with the key to change;
* the Triton kernels, in the interpreter (a subprocess with ``TRITON_INTERPRET=1``, as
  tests/test_kernel.py explains), against fp32 torch references: the rank-``bits`` QKV product, its
  gradient into the folded weights, and the residual add that generates the code.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megafixed.codes import FixedCode
from megafixed.config import ConfigError, ModelConfig

ROOT = Path(__file__).resolve().parent.parent


def _model_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=300, d_model=76, n_layers=2, n_heads=2, n_kv_heads=1, code_bits=9, code_scale=0.7,
                max_seq_len=32, mlp="swiglu")
    base.update(kw)
    return ModelConfig(**base)


def test_rmsnorm_of_a_code_is_a_gamma_scaling_and_the_fold_is_exact():
    from megafixed.kernels.fused_first_layer import fold, norm_alpha

    torch.manual_seed(0)
    code = FixedCode.gf2(9, seed=4, scale=0.7)
    ids = torch.randint(0, 300, (5, 7))
    d, eps = 76, 1e-5  # 76 = 8 * 9 + 4: a partial last tile
    gamma, w = torch.randn(d, dtype=torch.float64), torch.randn(11, d, dtype=torch.float64)
    x = code.encode(ids, d, torch.float64)
    normed = torch.nn.functional.rms_norm(x, (d,), gamma, eps)
    sign = torch.sign(x)
    assert torch.allclose(normed, norm_alpha(code, eps, torch.float64) * sign * gamma, rtol=1e-12, atol=0)
    c = (code.code_bits(ids) * 2 - 1).double()
    assert torch.allclose(normed @ w.t(), norm_alpha(code, eps, torch.float64) * c @ fold(w * gamma, 9).t(),
                          rtol=1e-10, atol=1e-12)
    # fold by hand: column k sums W's columns j with j % 9 == k
    want = torch.stack([w[:, k::9].sum(1) for k in range(9)], 1)
    assert torch.allclose(fold(w, 9), want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind,bias,d", [("canonical", False, 72), ("gf2", True, 76), ("gf2", False, 76)])
def test_fused_model_matches_unfused_outputs_and_gradients(kind, bias, d):
    from megafixed.model import GPT

    cfg = _model_cfg(input=kind, bias=bias, d_model=d)
    plain = GPT(cfg, seed=3)
    fused = GPT(ModelConfig(**{**cfg.__dict__, "fused_first_layer": True}), seed=3)
    assert fused.fused_first_layer and not plain.fused_first_layer
    assert fused.state_dict().keys() == plain.state_dict().keys()  # same parameters, same names
    ids, tgt = torch.randint(0, 300, (3, 16)), torch.randint(0, 300, (3, 16))
    calls = []
    import megafixed.model.fused as fm
    real = fm.fused_first_block
    fm.fused_first_block = lambda *a: calls.append(1) or real(*a)
    try:
        lf = fused(ids, tgt)
    finally:
        fm.fused_first_block = real
    assert calls == [1], "the fused path was not taken"
    lp = plain(ids, tgt)
    lp.backward()
    lf.backward()
    assert torch.allclose(lf, lp, rtol=1e-6, atol=1e-6)
    assert torch.allclose(fused(ids), plain(ids), rtol=1e-5, atol=1e-5)
    gp, gf = dict(plain.named_parameters()), dict(fused.named_parameters())
    for name in ("blocks.0.norm1.weight", "blocks.0.attn.wq.weight", "blocks.0.attn.wk.weight",
                 "blocks.0.attn.wv.weight", "blocks.0.attn.wo.weight", "blocks.0.mlp.w_in.weight"):
        assert gp[name].grad.abs().max() > 0
        assert torch.allclose(gf[name].grad, gp[name].grad, rtol=1e-4, atol=1e-6), name
    for name, p in gp.items():
        assert torch.allclose(gf[name].grad, p.grad, rtol=1e-4, atol=1e-6), name


def test_the_fused_block_saves_neither_the_code_nor_its_norm_for_backward():
    """What docs/parallelism.md counts for the paper config: the unfused block 0 keeps ``x0 = code(ids)``
    (the norm's input) and the normed ``x0`` (the q/k/v input) for its backward, ``[B, T, d]`` each;
    the fused one keeps the ``bits``-wide signs instead (``[B*T, bits]``, the product's input)."""
    from megafixed.model import GPT

    cfg = _model_cfg(input="gf2")
    B, T = 3, 16
    ids = torch.randint(0, 300, (B, T), generator=torch.Generator().manual_seed(0))
    saved = {}
    for fused in (False, True):
        model = GPT(ModelConfig(**{**cfg.__dict__, "fused_first_layer": fused}), seed=3)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict = {}  # saved activations (not the parameters), each storage once

        def pack(t, weights=weights, storages=storages):
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        cos, sin = model.rotary(T, ids.device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if fused:
                model.blocks[0](None, cos, sin, ids=ids, code_input=model.input)
            else:
                model.blocks[0](model.input(ids), cos, sin)
        saved[fused] = sum(storages.values())
    width, signs = B * T * cfg.d_model * 4, B * T * cfg.code_bits * 4  # fp32
    assert saved[False] - saved[True] >= 2 * width - signs, saved


def test_fused_model_with_activation_checkpointing_and_checkpoint_interchange():
    from megafixed.model import GPT

    cfg = _model_cfg(input="canonical", fused_first_layer=True)
    fused = GPT(cfg, seed=1)
    fused.activation_checkpointing = True
    plain = GPT(_model_cfg(input="canonical"), seed=5)
    plain.load_state_dict(fused.state_dict())  # a fused run's checkpoint loads into the plain model
    ids = torch.randint(0, 300, (2, 12))
    fused(ids, ids).backward()
    plain(ids, ids).backward()
    g1 = fused.blocks[0].attn.wk.weight.grad
    assert torch.allclose(g1, plain.blocks[0].attn.wk.weight.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["canonical", "gf2"])
def test_residual_dtype_under_autocast_is_the_same_fused_and_unfused(kind):
    """Under bf16 autocast the unfused model adds a bf16 attention output to its fp32 code, so its
    residual stream is fp32 from block 0 on; the fused block must hand block 1 the same dtype."""
    from megafixed.model import GPT

    cfg = _model_cfg(input=kind)
    seen = {}
    losses = {}
    for fused in (False, True):
        model = GPT(ModelConfig(**{**cfg.__dict__, "fused_first_layer": fused}), seed=3)
        model.blocks[1].register_forward_pre_hook(lambda m, args, f=fused: seen.__setitem__(f, args[0].dtype))
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[fused] = float(model(ids, ids).detach())
    assert seen == {False: torch.float32, True: torch.float32}
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)  # bf16 matmuls, same numerics up to order


def test_configs_and_layouts_the_fused_layer_cannot_serve_are_refused():
    from megafixed.config import Config
    from megafixed.parallel.layout import LayoutError
    from megafixed.run_plan import RunPlan

    with pytest.raises(ConfigError, match="model.fused_first_layer=true needs a fixed code"):
        _model_cfg(input="learned", fused_first_layer=True).validate()
    with pytest.raises(ConfigError, match="model.norm=rmsnorm"):
        _model_cfg(input="gf2", norm="layernorm", fused_first_layer=True).validate()
    cfg = Config(model=_model_cfg(input="gf2", n_kv_heads=2, n_layers=4, fused_first_layer=True))
    cfg.train.global_batch, cfg.train.micro_batch = 8, 2
    assert RunPlan.build(cfg, 2, gpu=False).dp == 2  # data parallelism is fine on both engines
    for tp, pp in ((2, 1), (1, 2)):
        cfg.parallel.tp, cfg.parallel.pp = tp, pp
        cfg.train.engine = "deepspeed"  # its TP layers are megatron-core's, its pipeline runs no GPT.forward
        with pytest.raises(LayoutError, match="fused_first_layer=true runs under train.engine=deepspeed for the "
                                              "plain model only") as info:
            RunPlan.build(cfg, 2, gpu=False)
        assert "\n" not in str(info.value) and "train.engine=torch" in str(info.value)
        cfg.train.engine = "torch"  # at every layout (tests/test_native_pipeline.py trains them)
        assert (RunPlan.build(cfg, 4, gpu=False).tp, RunPlan.build(cfg, 4, gpu=False).pp) == (tp, pp)
    # ... where the first pipeline stage holds block 0 beside the input, since the fused layer runs in
    # block 0 from the ids (2 blocks + input + head over 4 stages: the first holds the input alone)
    cfg.parallel.pp_schedule, cfg.parallel.vpp, cfg.model.n_layers = "Interleaved1F1B", 2, 2
    with pytest.raises(LayoutError, match=r"the first pipeline stage holds the input alone .* lower "
                                          r"parallel\.pp_input_head_layers or parallel\.vpp") as info:
        RunPlan.build(cfg, 2, gpu=False)
    assert "\n" not in str(info.value)
    cfg.parallel.pp_schedule, cfg.parallel.vpp = "1F1B", 1
    assert RunPlan.build(cfg, 2, gpu=False).pp == 2


def test_the_fused_block_compiles_into_one_graph_with_the_eager_numbers():
    """``train.compile``: Dynamo captures the fused first block whole (one graph per block: no graph
    break, e.g. at the norm's code scale read as a Python float), with the eager numbers. The graphs
    run as captured (a counting backend); Inductor's code generation is the compiled-blocks run's
    (tests/test_native_engine.py)."""
    from megafixed.model import GPT

    graphs = []

    def counting(graph, _example_inputs):
        graphs.append(graph)
        return graph.forward

    cfg = _model_cfg(input="gf2", fused_first_layer=True)
    eager, compiled = GPT(cfg, seed=3), GPT(cfg, seed=3)
    for block in compiled.blocks:
        block.compile(backend=counting)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    want, got = eager(ids, ids), compiled(ids, ids)
    assert len(graphs) == len(compiled.blocks), [g.code for g in graphs]
    want.backward()
    got.backward()
    assert torch.equal(got, want)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(b.grad, a.grad), name


# ============================================================================ Triton, interpreted
def _mixed_add_matches(y: torch.Tensor, ids: torch.Tensor, code) -> bool:
    from megafixed.kernels.fused_first_layer import add_code

    y = y.requires_grad_(True)
    got = add_code(y, ids, code, force_kernel=True, code_dtype=torch.float32)
    got.sum().backward()
    want = code.encode(ids, y.shape[-1], torch.float32) + y.detach()
    return got.dtype == torch.float32 and y.grad.dtype == y.dtype and bool(torch.equal(got.detach(), want))


def _worker() -> dict:
    from megafixed.kernels.fused_first_layer import add_code, code_qkv, code_qkv_reference, fold, norm_alpha
    from megafixed.kernels.token_codes import kernel_is_interpreted

    out = {"interpreted": kernel_is_interpreted(), "cases": {}}
    gen = torch.Generator().manual_seed(0)
    for name, code in (("canonical16", FixedCode.canonical(16)), ("gf2_9", FixedCode.gf2(9, seed=2, scale=0.7)),
                       ("gf2_16", FixedCode.gf2(16, seed=1, scale=1.0))):
        ids = torch.randint(0, 1 << code.bits, (3, 37), generator=gen)
        w = torch.randn(200, 80, generator=gen)  # 200 outputs: a partial output block
        folded = fold(w, code.bits).requires_grad_(True)
        alpha = norm_alpha(code, 1e-5, torch.float32)
        got = code_qkv(ids, code, folded, alpha, force_kernel=True)
        gout = torch.randn(got.shape, generator=gen)
        (got * gout).sum().backward()
        g_kernel = folded.grad.clone()
        folded.grad = None
        want = code_qkv_reference(ids, code, folded, alpha)
        (want * gout).sum().backward()
        y = torch.randn(3, 37, 80, generator=gen)
        added = add_code(y, ids, code, force_kernel=True)
        out["cases"][name] = {
            "qkv_max_err": float((got - want).abs().max()), "qkv_scale": float(want.abs().max()),
            "grad_max_err": float((g_kernel - folded.grad).abs().max()), "grad_scale": float(folded.grad.abs().max()),
            "add_bit_identical": bool(torch.equal(added, code.encode(ids, 80, torch.float32) + y)),
            # Autocast: a bf16 attention output plus the unfused input's fp32 code is an fp32 residual.
            "add_mixed_bit_identical": _mixed_add_matches(y.bfloat16(), ids, code),
            # The interpreter truncates fp32 -> bf16 where a GPU rounds to nearest even, so bf16 is
            # checked to one bf16 ulp here and bit for bit by tools/gpu_check.sh on a GPU.
            "add_bf16_max_rel_err": float(((add_code(y.bfloat16(), ids, code, force_kernel=True).float()
                                            - (code.encode(ids, 80, torch.bfloat16) + y.bfloat16()).float()).abs()
                                           / (code.encode(ids, 80, torch.float32) + y).abs()).max()),
        }
    return out


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@needs_triton
def test_triton_kernels_match_torch_in_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "MEGAFIXED_FORCE_TRITON"}
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "worker"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["interpreted"] is True
    for name, c in res["cases"].items():
        assert c["qkv_max_err"] <= 1e-5 * max(1.0, c["qkv_scale"]), (name, c)
        assert c["grad_max_err"] <= 1e-4 * max(1.0, c["grad_scale"]), (name, c)
        assert c["add_bit_identical"], name
        assert c["add_mixed_bit_identical"], name
        assert c["add_bf16_max_rel_err"] <= 2 ** -7, name


def _worker_aot() -> dict:
    """Without the interpreter: lower both fused kernels (GF(2) branch, bf16) to sm_90, no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megafixed.kernels.fused_first_layer import _add_code_kernel, _code_qkv_kernel

    common = {"ids_ptr": "*i64", "rows_ptr": "*i32", "shift": "i32", "BITS": "constexpr", "CANONICAL": "constexpr"}
    qkv = ASTSource(_code_qkv_kernel, {**common, "f_ptr": "*bf16", "out_ptr": "*bf16", "n_tokens": "i32",
                                       "n_out": "i32", "alpha": "fp32", "BLOCK_N": "constexpr", "BLOCK_O": "constexpr"},
                    constexprs={"BITS": 16, "CANONICAL": False, "BLOCK_N": 64, "BLOCK_O": 128})
    add = ASTSource(_add_code_kernel, {**common, "y_ptr": "*bf16", "out_ptr": "*bf16", "n_tokens": "i32",
                                       "width": "i32", "pos_val": "fp32", "neg_val": "fp32", "BLOCK_T": "constexpr",
                                       "BLOCK_W": "constexpr"},
                    constexprs={"BITS": 16, "CANONICAL": False, "BLOCK_T": 16, "BLOCK_W": 512})
    target = GPUTarget("cuda", 90, 32)
    return {name: len(triton.compile(src, target=target, options={"num_warps": 4}).asm["cubin"])
            for name, src in (("qkv", qkv), ("add", add))}


@needs_triton
def test_fused_kernels_lower_to_sm90():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MEGAFIXED_FORCE_TRITON")}
    proc = subprocess.run([sys.executable, __file__, "aot"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["qkv"] > 0 and res["add"] > 0


if __name__ == "__main__":
    print(json.dumps(_worker_aot() if sys.argv[1] == "aot" else _worker()))
