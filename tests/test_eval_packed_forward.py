"""The packed zero-shot scorer (``megafixed.eval.packed``) runs the model's own forward.

Rows of several documents go through ``GPT.forward`` with per-token ``positions`` and an
``attn_mask``; each scored request must get what its own plain causal forward gives, and any change
to the model's attention must reach eval's numbers (eval cannot drift from training).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megafixed.config import ModelConfig
from megafixed.eval.packed import make_tree, pack, score_rows
from megafixed.model import GPT
from megafixed.model.gpt import Attention

# (input, fused first layer): a learned table, and a fixed code whose block 0 runs the fused path
MODELS = [("learned", False), ("gf2", True)]


def _model(input: str, fused: bool) -> GPT:
    cfg = ModelConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, code_bits=9, max_seq_len=64,
                      mlp="swiglu", input=input, fused_first_layer=fused)
    return GPT(cfg, seed=1).eval()


def _groups() -> list[tuple[list[tuple[list[int], list[int]]], int]]:
    """Documents as (requests, shared prefix length); a request is (model input, continuation ids)."""
    gen = torch.Generator().manual_seed(0)

    def toks(n):
        return torch.randint(0, 300, (n,), generator=gen).tolist()

    groups = []
    for ctx_len, conts in [(11, [3, 5, 2, 4]), (6, [1, 7]), (20, [2])]:
        ctx = toks(ctx_len)
        requests = []
        for n in conts:
            cont = toks(n)
            requests.append(((ctx + cont)[:-1], cont))
        groups.append((requests, ctx_len - 1 if len(conts) > 1 else 0))
    return groups


@torch.inference_mode()
def _packed(model) -> dict[tuple[int, int], float]:
    trees = [make_tree(gi, requests, p) for gi, (requests, p) in enumerate(_groups())]
    rows = pack(trees, 40)  # sizes 24, 21, 13: two documents share a row, the other row is padded
    assert sorted(len(set(r.doc)) for r in rows) == [1, 2]
    return {(gi, ri): ll for gi, ri, ll, _ in score_rows(model, rows, torch.device("cpu"))}


@torch.inference_mode()
def _plain(model) -> dict[tuple[int, int], float]:
    """Each request alone, through the plain causal forward."""
    out = {}
    for gi, (requests, _) in enumerate(_groups()):
        for ri, (x, cont) in enumerate(requests):
            lp = F.log_softmax(model(torch.tensor([x])).float(), dim=-1)[0]
            first = len(x) - len(cont)
            out[gi, ri] = sum(float(lp[first + j, c]) for j, c in enumerate(cont))
    return out


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-4) for k in a)


@pytest.mark.parametrize("input,fused", MODELS)
def test_packed_rows_score_what_each_requests_causal_forward_scores(input, fused):
    model = _model(input, fused)
    assert _close(_packed(model), _plain(model))


@pytest.mark.parametrize("input,fused", MODELS)
def test_a_change_to_attention_forward_changes_the_packed_scores_alike(input, fused, monkeypatch):
    model = _model(input, fused)
    before = _packed(model)
    real = Attention.forward
    # a sharper softmax (q and k scaled 3x each, the attention logits 9x), as a model change would make;
    # packed and plain forwards differ by ~1e-6 here, the change moves every score by more than 1e-4
    monkeypatch.setattr(Attention, "forward", lambda self, x, *a, **kw: real(self, 3.0 * x, *a, **kw))
    after = _packed(model)
    assert all(abs(after[k] - before[k]) > 1e-4 for k in before), "eval did not run the model's attention"
    assert _close(after, _plain(model))  # and it still equals the (changed) plain forward


def test_without_positions_or_mask_attention_is_sdpas_plain_causal_kernel(monkeypatch):
    """Training's path: no mask tensor, ``is_causal``, as before the packed scorer's arguments existed."""
    model = _model("learned", False)
    calls, real = [], F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        model(torch.randint(0, 300, (2, 9)))
        assert calls == [(None, True)] * 2
        calls.clear()
        mask = torch.ones(9, 9, dtype=torch.bool).tril()
        model(torch.randint(0, 300, (2, 9)), positions=torch.arange(9).expand(2, 9), attn_mask=mask)
        assert [(m is mask, causal) for m, causal in calls] == [(True, False)] * 2


def test_positions_or_a_mask_with_a_cache_are_refused():
    from megafixed.model.generate import KVCache

    model = _model("learned", False)
    ids = torch.randint(0, 300, (1, 4))
    with torch.no_grad(), pytest.raises(ValueError, match="cache"):
        model(ids, cache=KVCache(2, 8), positions=torch.arange(4)[None])
    with torch.no_grad(), pytest.raises(ValueError, match="cache"):
        model(ids, cache=KVCache(2, 8), attn_mask=torch.ones(4, 4, dtype=torch.bool))


def test_training_after_an_inference_mode_eval_in_the_same_process(monkeypatch):
    """The RoPE tables are kept by the model once made: made first by an eval under ``torch.inference_mode``
    (the packed scorer, or any scorer), they must still serve a training step's backward afterwards (an
    inference tensor cannot be saved for backward)."""
    model = _model("gf2", False)
    assert not model.rotary.tables  # this test makes them
    _packed(model)
    assert model.rotary.tables and all(not t.is_inference() for pair in model.rotary.tables.values() for t in pair)
    model.train()
    ids = torch.randint(0, 300, (2, 16))
    loss = model(ids, ids)
    loss.backward()
    assert all(p.grad is not None for p in model.blocks.parameters())
