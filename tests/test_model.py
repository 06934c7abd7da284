"""The GPT against an independent plain-torch reference, and the input interfaces' contracts."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megafixed.config import load_config
from megafixed.model import GPT, FixedCodeInput, LearnedInput

TINY = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.code_bits=8",
        "model.max_seq_len=32", "data.seq_len=32"]


def tiny(*overrides):
    return load_config(None, TINY + list(overrides)).model


def reference_forward(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """Logits written out from the equations (RMSNorm, RoPE half-split, masked softmax, GELU)."""
    cfg = model.cfg
    B, T = ids.shape
    if cfg.input == "learned":
        x = model.input.embedding.weight[ids]
    else:  # +-1 by the documented convention: column j uses code bit j mod bits
        code = model.input.code  # bit i of the code = parity(row_i(A) & id) xor b_i
        parity = torch.tensor([[[bin(int(v) & r).count("1") % 2 for r in code.rows] for v in row] for row in ids])
        bits = parity ^ torch.tensor([(code.shift >> i) & 1 for i in range(code.bits)])
        cols = torch.arange(cfg.d_model) % code.bits
        x = (bits[..., cols] * 2 - 1).float() * code.scale

    def rms(v, w):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = ang.cos().float(), ang.sin().float()

    def rope(v):  # v: B, T, H, hd
        a, b = v[..., : hd // 2], v[..., hd // 2:]
        c, s = cos[None, :, None], sin[None, :, None]
        return torch.cat([a * c - b * s, a * s + b * c], -1)

    mask = torch.full((T, T), float("-inf")).triu(1)
    for blk in model.blocks:
        h = rms(x, blk.norm1.weight)
        q = rope((h @ blk.attn.wq.weight.T).view(B, T, cfg.n_heads, hd))
        k = rope((h @ blk.attn.wk.weight.T).view(B, T, cfg.n_heads, hd))
        v = (h @ blk.attn.wv.weight.T).view(B, T, cfg.n_heads, hd)
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd) + mask
        y = torch.einsum("bhqk,bkhd->bqhd", att.softmax(-1), v).reshape(B, T, -1)
        x = x + y @ blk.attn.wo.weight.T
        h = rms(x, blk.norm2.weight)
        x = x + F.gelu(h @ blk.mlp.w_in.weight.T) @ blk.mlp.w_out.weight.T
    return rms(x, model.head.norm.weight) @ model.head.proj.weight.T


@pytest.mark.parametrize("kind", ["learned", "canonical", "gf2"])
def test_forward_matches_plain_reference(kind):
    torch.manual_seed(0)
    model = GPT(tiny(f"model.input={kind}", "model.code_seed=7")).eval()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ours, ref = model(ids), reference_forward(model, ids)
        loss = model(ids[:, :-1], ids[:, 1:])
        # The loss over the shifted pair is the plain next-token NLL of the same model.
        ref_on_prefix = reference_forward(model, ids[:, :-1])
        expected = -ref_on_prefix.log_softmax(-1).gather(-1, ids[:, 1:, None]).mean()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("kind", ["canonical", "gf2"])
def test_fixed_inputs_have_no_parameters_and_emit_the_code(kind):
    model = GPT(tiny(f"model.input={kind}"))
    assert isinstance(model.input, FixedCodeInput)
    assert list(model.input.parameters()) == []
    ids = torch.arange(256)
    x = model.input(ids)
    assert x.shape == (256, 64) and set(x.unique().tolist()) == {-1.0, 1.0}
    assert len({tuple(r) for r in x[:, :8].tolist()}) == 256  # injective on the first tile
    if kind == "canonical":  # bit j%8 of the id, LSB first
        expect = ((ids[:, None] >> (torch.arange(64) % 8)) & 1) * 2.0 - 1
        assert torch.equal(x, expect)
    # A and b travel in the state dict as buffers
    sd = model.state_dict()
    assert {"input.code_rows", "input.code_shift", "input.code_scale"} <= set(sd)


def test_learned_input_is_a_trainable_table():
    model = GPT(tiny("model.input=learned"))
    assert isinstance(model.input, LearnedInput)
    assert model.input.embedding.weight.shape == (256, 64) and model.input.embedding.weight.requires_grad


def test_mismatched_code_is_refused_on_load():
    a = GPT(tiny("model.input=gf2", "model.code_seed=1"))
    b = GPT(tiny("model.input=gf2", "model.code_seed=2"))
    with pytest.raises(RuntimeError, match=r"fixed code mismatch at input\.code_rows.*model\.code_seed"):
        b.load_state_dict(a.state_dict())
    c = GPT(tiny("model.input=gf2", "model.code_seed=1"))
    c.load_state_dict(a.state_dict())  # same code: fine
    assert torch.equal(c.input.code_rows, a.input.code_rows)


def test_causal_and_checkpointing_preserves_gradients():
    torch.manual_seed(0)
    model = GPT(tiny("model.input=canonical"))
    ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        base = model(ids[:, :16])
        changed = ids[:, :16].clone()
        changed[:, 10] = (changed[:, 10] + 1) % 256
        assert torch.equal(model(changed)[:, :10], base[:, :10])
        assert not torch.allclose(model(changed)[:, 10:], base[:, 10:])
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.activation_checkpointing = ckpt
        model(ids[:, :-1], ids[:, 1:]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g0, g1 in zip(*grads, strict=True):
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)


def test_tied_head_shares_the_table_and_init_scales_residual_outputs():
    model = GPT(load_config(None, TINY + ["model.input=learned", "model.tie_embeddings=true",
                                          "model.n_layers=8", "model.d_model=256", "model.n_heads=4"]).model)
    assert model.head.proj.weight is model.input.embedding.weight
    std_in = model.blocks[0].mlp.w_in.weight.std().item()
    std_out = model.blocks[0].mlp.w_out.weight.std().item()
    assert std_in == pytest.approx(0.02, rel=0.05)
    assert std_out == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


def test_ids_beyond_the_model_vocab_are_refused_on_the_host_with_the_fix():
    from megafixed.engine.batches import TokenRangeError, split_tokens

    ok = torch.tensor([[0, 999, 5]])
    inputs, labels = split_tokens(ok, "cpu", vocab_size=1000)
    assert inputs.tolist() == [[0, 999]] and labels.tolist() == [[999, 5]]
    # 1000 fits a 16-bit code but not the model's head: the data and the config disagree.
    with pytest.raises(TokenRangeError, match=r"token id 1000 .*model.vocab_size=1000.*data.tokenizer"):
        split_tokens(torch.tensor([[5, 1000]]), "cpu", vocab_size=1000)
    with pytest.raises(TokenRangeError, match="token id -1"):
        split_tokens(torch.tensor([[-1, 3]]), "cpu", vocab_size=1000)


class _ScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts device-to-host reads (``.item()``, ``int(t)``, ``bool(t)`` all go through
    ``aten._local_scalar_dense``): on a GPU each one is a synchronisation."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["canonical", "gf2", "learned"])
def test_forward_and_backward_read_nothing_back_to_the_host(kind):
    model = GPT(tiny(f"model.input={kind}"))
    ids = torch.randint(0, 256, (2, 16))
    with _ScalarReads() as reads:
        model(ids[:, :-1], ids[:, 1:]).backward()
    assert reads.count == 0


def test_same_seed_gives_the_same_backbone_for_every_interface():
    """The paired comparison of the paper: only the input differs at the same seed."""
    models = {kind: GPT(tiny(f"model.input={kind}"), seed=11) for kind in ("learned", "canonical", "gf2")}
    backbone = {n: p for n, p in models["canonical"].named_parameters()}
    assert backbone and not any(n.startswith("input.") for n in backbone)
    for kind in ("learned", "gf2"):
        theirs = dict(models[kind].named_parameters())
        assert set(theirs) - set(backbone) == ({"input.embedding.weight"} if kind == "learned" else set())
        for name, p in backbone.items():
            assert torch.equal(theirs[name], p), f"{kind}: {name} differs from the canonical model's"
    other_seed = GPT(tiny("model.input=canonical"), seed=12)
    assert not torch.equal(other_seed.blocks[0].attn.wq.weight, backbone["blocks.0.attn.wq.weight"])


def test_meta_construction_then_init_equals_the_eager_model():
    from megafixed.model import init_parameters

    cfg = tiny("model.input=learned", "model.mlp=swiglu", "model.bias=true", "model.norm=layernorm")
    eager = GPT(cfg, seed=3)
    with torch.device("meta"):
        lazy = GPT(cfg, seed=3)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    init_parameters(lazy, cfg, seed=3)
    for (n, a), (n2, b) in zip(eager.named_parameters(), lazy.named_parameters(), strict=True):
        assert n == n2 and torch.equal(a, b), (n, n2)


def test_rope_tables_stay_fp32_after_a_half_precision_cast():
    model = GPT(tiny("model.input=gf2", "model.code_scale=0.3"))
    cos_before, _ = model.rotary(16, torch.device("cpu"))
    model.bfloat16()  # what DeepSpeed's bf16 mode does to every module (every pipeline stage too)
    cos_after, sin_after = model.rotary(16, torch.device("cpu"))
    assert cos_after.dtype == sin_after.dtype == torch.float32 and torch.equal(cos_after, cos_before)
    assert not [n for n, _ in model.named_buffers() if "rope" in n]  # nothing for a cast to reach
    assert not [k for k in model.state_dict() if "rotary" in k or "rope" in k]  # nor for a checkpoint


