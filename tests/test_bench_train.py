"""``megafixed bench train``: a tiny config on mock data through both loops, and the JSON it writes."""
from __future__ import annotations

import argparse
import json

import pytest

from _train_data import TINY_MODEL


def test_bench_train_reports_both_loops_and_the_overhead(tmp_path, capsys):
    from megafixed.bench import train as bt

    p = argparse.ArgumentParser()
    bt.add_arguments(p)
    out = tmp_path / "t.json"
    args = p.parse_args([str(__import__("pathlib").Path(__file__).parent.parent / "examples/configs/quickstart.yaml"),
                         *TINY_MODEL, "data.mock=true", "model.fused_first_layer=true", "train.global_batch=4",
                         "train.micro_batch=2", f"train.run_dir={tmp_path / 'run'}", "--steps", "4",
                         "--warmup-steps", "1", "--rounds", "2", "--json", str(out),
                         "--engines", "deepspeed"])  # both engines: tests/test_native_cli.py
    assert bt.run(args) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "train" and r["mock_data"] is True and r["fused_first_layer"] is True
    assert r["tokens_per_step"] == 4 * 32 and r["accum"] == 2 and r["precision"] == "fp32"
    for name in ("bare", "framework"):
        s = r[name]
        assert s["steps_timed"] == 4 and len(s["step_times_s"]) == 4
        assert s["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / s["step_s_median"])
        assert s["mfu"] is None  # CPU: no bf16 peak to divide by
    assert r["overhead"] == pytest.approx(r["framework"]["step_s_median"] / r["bare"]["step_s_median"] - 1)
    assert r["peak_rss_bytes"]["end"] > 0
    text = capsys.readouterr().out
    assert "framework overhead vs the bare loop" in text and "tokens/s" in text
    assert not (tmp_path / "run").exists()  # a benchmark leaves no run directory behind
    with pytest.raises(Exception, match="already exists"):
        bt.run(args)


def _bare_state(precision: str, grad_clip: float = 1.0):
    from types import SimpleNamespace

    import torch

    from megafixed.bench.bare_loop import BareLoopState
    from megafixed.config import load_config

    root = __import__("pathlib").Path(__file__).parent.parent
    cfg = load_config(str(root / "examples/configs/quickstart.yaml"),
                      [*TINY_MODEL, "data.mock=true", f"optimizer.grad_clip={grad_clip}"])
    topo = SimpleNamespace(tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0, device=torch.device("cpu"),
                           init_device=None)
    return cfg, BareLoopState(cfg, topo, precision)


def test_bare_loop_bf16_is_the_engines_recipe_16_bit_weights_fp32_masters_and_accumulation():
    """The overhead figure compares like with like: under bf16 the bare loop runs bf16 weights and code
    (as DeepSpeed's engine), accumulates micro-batch gradients in fp32 and updates fp32 masters."""
    import torch

    cfg, st = _bare_state("bf16")
    assert {p.dtype for p in st.model.parameters()} == {torch.bfloat16}
    assert st.model.input.out_dtype == torch.bfloat16 and st.model.input.code_scale.dtype == torch.float64
    assert {m.dtype for m in st.masters} == {torch.float32}
    gen = torch.Generator().manual_seed(0)
    micro = [(lambda t: (t[:, :-1], t[:, 1:]))(torch.randint(0, 256, (2, 33), generator=gen)) for _ in range(2)]
    # independent reference: per-micro-batch bf16 gradients summed in fp32, torch AdamW on an fp32 copy
    ref = [m.detach().clone().requires_grad_(False) for m in st.masters]
    acc = [torch.zeros_like(r) for r in ref]
    for inputs, labels in micro:
        st.model.zero_grad(set_to_none=True)
        (st.model(inputs, labels) / 2).backward()
        for a, p in zip(acc, st.params, strict=True):
            a += p.grad.float()
    st.model.zero_grad(set_to_none=True)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(a) for a in acc]))
    coef = min(1.0, cfg.optimizer.grad_clip / (float(norm) + 1e-6))
    where = {id(m): i for i, m in enumerate(st.masters)}
    groups = [{"params": [ref[where[id(m)]] for m in g["params"]], "weight_decay": g["weight_decay"]}
              for g in st.opt.param_groups]
    opt = torch.optim.AdamW(groups, lr=cfg.optimizer.lr, betas=(cfg.optimizer.beta1, cfg.optimizer.beta2),
                            eps=cfg.optimizer.eps)
    for r, a in zip(ref, acc, strict=True):
        r.grad = a * coef
    opt.step()
    st.step(micro)
    for m, r, p in zip(st.masters, ref, st.params, strict=True):
        assert torch.allclose(m, r, rtol=1e-5, atol=1e-7)
        assert torch.equal(p.detach(), m.to(torch.bfloat16))  # the 16-bit weights are the rounded masters
        assert not m.grad.any()  # the fp32 accumulators start the next step at zero


def test_bare_loop_fp16_scales_the_loss_and_skips_an_overflowed_step():
    import torch

    _, st = _bare_state("fp16", grad_clip=0.0)
    assert st.scaler is not None and st.scaler.get_scale() == 2.0 ** 16
    gen = torch.Generator().manual_seed(1)
    micro = [(lambda t: (t[:, :-1], t[:, 1:]))(torch.randint(0, 256, (2, 33), generator=gen))]
    before = [m.clone() for m in st.masters]
    # certain overflow of the fp16 gradients: the update must be skipped and the scale lowered
    st.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 60, growth_interval=1000)
    st.step(micro)
    assert all(torch.equal(a, b) for a, b in zip(before, st.masters, strict=True)) and st.scaler.get_scale() < 2.0 ** 60
    st.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    st.step(micro)
    assert any(not torch.equal(a, b) for a, b in zip(before, st.masters, strict=True))
    assert all(torch.isfinite(m).all() for m in st.masters)
