"""The correctness half of ``tools/gpu_check.sh`` (a one-command GPU check; never part of
the test suite, which has no GPU).

``python -m megafixed.bench.gpu_check verify OUT.json``: on CUDA,

* the token-code kernel bit for bit against ``FixedCode.encode`` for fp32, bf16, fp16 and fp64,
  canonical and GF(2) codes, scales that do and do not round, ragged widths, int32 and int64 ids;
* the fused first layer's kernels: the residual add that generates the code, bit for bit in every
  dtype; the rank-``bits`` QKV product and its gradient against fp32 torch references;
* a fused vs an unfused model, fp32 on the GPU (kernels active): loss, logits and every gradient.

``report DIR [OUT]`` (``gpu_report.py``) merges the stages' JSON into ``gpu_check.json`` and a markdown
summary; ``preflight`` is ``gpu_preflight.py``; the end-to-end stages are ``gpu_stages.py``; the trace, roofline
and float8 stages ``gpu_perf_stages.py``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(INT_VIEW[a.dtype]),
                                                                       b.contiguous().view(INT_VIEW[b.dtype]))


def verify(device: str = "cuda", save=None) -> dict:
    from ..codes import FixedCode
    from ..config import ModelConfig
    from ..kernels import token_codes
    from ..kernels.fused_first_layer import add_code, code_qkv, code_qkv_reference, fold, norm_alpha
    from ..model import GPT
    from ..model.interfaces import names

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    codes = {"canonical16": FixedCode.canonical(16), "gf2_16_affine_s0.1": FixedCode.gf2(16, seed=3, scale=0.1),
             "gf2_5_linear": FixedCode.gf2(5, seed=1, affine=False), "canonical24_s2.5": FixedCode.canonical(24, 2.5)}
    failures, checked = [], 0
    # Every code in every dtype at width 2,048 with int64 ids, plus ragged widths and int32 ids for one code:
    # each distinct (dtype, bits, block shape, id type) is a fresh Triton compile, and the check must stay quick.
    cases = [(c, 2048, dt, torch.int64) for c in codes for dt in INT_VIEW]
    cases += [("gf2_16_affine_s0.1", w, dt, torch.int32) for w in (16, 37, 4100) for dt in (torch.bfloat16,
                                                                                           torch.float32)]
    cases += [("gf2_5_linear", 5, torch.float16, torch.int64), ("canonical24_s2.5", 24, torch.float32, torch.int32)]
    for cname, width, dtype, id_dtype in cases:
        code = codes[cname]
        ids = torch.randint(0, 1 << code.bits, (7, 301), generator=gen).to(dev, id_dtype)
        got = token_codes(ids, code, width, dtype, force_kernel=dev.type == "cuda")
        checked += 1
        if not _same_bits(got, code.encode(ids, width, dtype)):
            failures.append(f"token_codes {cname} w{width} {dtype} {id_dtype}")
        y = torch.randn(7, 301, width, generator=gen).to(dev, dtype)
        if not _same_bits(add_code(y, ids, code), code.encode(ids, width, dtype) + y):
            failures.append(f"add_code {cname} w{width} {dtype} {id_dtype}")
    qkv, model, edge = {}, {}, {}

    def result(complete: bool) -> dict:
        return {"bench": "verify", "device": str(dev), "device_name": torch.cuda.get_device_name(dev)
                if dev.type == "cuda" else "cpu", "cases_checked": checked, "failures": failures,
                "ok": not failures, "code_qkv": qkv, "fused_model_fp32": model, "edge_cases": edge,
                "torch": torch.__version__, "complete": complete}

    if save is not None:  # after each part: a stage stopped at its limit keeps what was checked
        save(result(False))
    for cname, code in codes.items():
        ids = torch.randint(0, 1 << code.bits, (4, 513), generator=gen).to(dev)
        w = torch.randn(3 * 256, 2048, generator=gen).to(dev)
        folded = fold(w, code.bits).requires_grad_(True)
        alpha = norm_alpha(code, 1e-5, torch.float32)
        got = code_qkv(ids, code, folded, alpha)
        g = torch.randn(got.shape, generator=gen).to(dev)
        (got * g).sum().backward()
        g_kernel, folded.grad = folded.grad.clone(), None
        want = code_qkv_reference(ids, code, folded, alpha)
        (want * g).sum().backward()
        got, want = got.detach(), want.detach()
        err = float((got - want).abs().max() / want.abs().max())
        gerr = float((g_kernel - folded.grad).abs().max() / folded.grad.abs().max())
        qkv[cname] = {"rel_err": err, "grad_rel_err": gerr}
        if err > 1e-5 or gerr > 1e-5:
            failures.append(f"code_qkv {cname}: rel err {err:.2e}, grad {gerr:.2e}")
    if save is not None:
        save(result(False))
    for kind in names(lambda i: i.has_code):  # every fixed-code interface, fused against plain
        cfg = ModelConfig(vocab_size=4096, d_model=512, n_layers=2, n_heads=8, code_bits=12, input=kind,
                          max_seq_len=256)
        plain = GPT(cfg, seed=1).to(dev)
        fused = GPT(ModelConfig(**{**cfg.__dict__, "fused_first_layer": True}), seed=1).to(dev)
        ids = torch.randint(0, 4096, (4, 256), generator=gen).to(dev)
        lp, lf = plain(ids, ids), fused(ids, ids)
        lp.backward()
        lf.backward()
        lp, lf = lp.detach(), lf.detach()
        gerr = max(float((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-30))
                   for a, b in zip(fused.parameters(), plain.parameters()))
        model[kind] = {"loss_plain": float(lp), "loss_fused": float(lf), "max_grad_rel_err": gerr}
        if abs(float(lp) - float(lf)) > 1e-4 * abs(float(lp)) or gerr > 1e-3:
            failures.append(f"fused model {kind}: loss {float(lf)} vs {float(lp)}, grad rel err {gerr:.2e}")
    if save is not None:
        save(result(False))
    edge.update(edge_cases(dev, failures))
    return result(True)


def edge_cases(dev: torch.device, failures: list, big: bool = True) -> dict:
    """What the first sweep does not reach: outputs beyond 2^31 elements (int64 offsets; spot-checked rows),
    non-contiguous inputs, a code with shift 1, one token, and int32 ids through the whole model."""
    from ..codes import FixedCode
    from ..config import ModelConfig
    from ..kernels import token_codes
    from ..kernels.fused_first_layer import add_code, code_qkv, code_qkv_reference, fold, norm_alpha
    from ..model import GPT

    done = {}
    gen = torch.Generator().manual_seed(5)
    shift1 = FixedCode(bits=16, rows=tuple(1 << i for i in range(16)), shift=1, scale=1.0, kind="gf2")
    codes = {"gf2_16": FixedCode.gf2(16, seed=3, scale=0.1), "shift1_16": shift1}
    kernel = dev.type == "cuda"

    def check(name: str, ok: bool, detail: str = "") -> None:
        done[name] = bool(ok)
        if not ok:
            failures.append(f"{name} {detail}".strip())

    for cname, code in codes.items():
        ids = torch.randint(0, 1 << 16, (6, 50), generator=gen).to(dev)
        for label, view in (("strided ids", ids[:, ::2]), ("one token", ids[:1, :1])):
            got = token_codes(view, code, 40, torch.bfloat16, force_kernel=kernel)
            check(f"token_codes {cname} {label}", _same_bits(got, code.encode(view, 40, torch.bfloat16)))
            y = torch.randn(view.shape[1], view.shape[0], 40, generator=gen).to(dev, torch.bfloat16).transpose(0, 1)
            check(f"add_code {cname} {label}, transposed y", _same_bits(add_code(y, view, code, force_kernel=kernel),
                                                                         code.encode(view, 40, torch.bfloat16) + y))
            folded = torch.randn(16, 96, generator=gen).to(dev).t()  # [96, 16] folded weights, non-contiguous
            alpha = norm_alpha(code, 1e-5, torch.float32)
            got = code_qkv(view, code, folded, alpha, force_kernel=kernel)
            want = code_qkv_reference(view, code, folded, alpha)
            check(f"code_qkv {cname} {label}", float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()))
    if big and kernel:  # > 2^31 elements: the int64 offsets of both kernels, spot-checked rows
        free = torch.cuda.mem_get_info(dev)[0]
        width = 8192
        n = (1 << 31) // width + 3
        if free > 12 * n * width:
            code = codes["gf2_16"]
            ids = torch.randint(0, 1 << 16, (n,), generator=gen).to(dev)
            rows = torch.tensor([0, 1, n // 2, n - 2, n - 1], device=dev)
            out = token_codes(ids, code, width, torch.bfloat16, force_kernel=True)
            check("token_codes > 2^31 elements", _same_bits(out[rows], code.encode(ids[rows], width, torch.bfloat16)))
            del out
            y = torch.ones(n, width, device=dev, dtype=torch.bfloat16)
            out = add_code(y, ids, code, force_kernel=True)
            check("add_code > 2^31 elements",
                  _same_bits(out[rows], code.encode(ids[rows], width, torch.bfloat16) + y[rows]))
            del out, y
            n_out = 3 * 2048
            nq = (1 << 31) // n_out + 3
            folded = fold(torch.randn(n_out, 2048, generator=gen).to(dev, torch.bfloat16), 16)
            alpha = norm_alpha(code, 1e-5, torch.bfloat16)
            q = code_qkv(ids[:nq], code, folded, alpha, force_kernel=True)
            rq = rows.clamp_max(nq - 1)
            want = code_qkv_reference(ids[:nq][rq], code, folded, alpha)
            check("code_qkv > 2^31 elements", float((q[rq].float() - want.float()).abs().max())
                  <= 1e-2 * float(want.float().abs().max()))
            del q, ids
            torch.cuda.empty_cache()
        else:
            done["> 2^31 elements"] = f"skipped: {free / 2**30:.0f} GiB free"
    for fused in (False, True):  # int32 ids and a single token through the whole model
        cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, code_bits=12, input="gf2",
                          max_seq_len=64, fused_first_layer=fused)
        model = GPT(cfg, seed=2).to(dev)
        ids = torch.randint(0, 4096, (2, 64), generator=gen).to(dev)
        with torch.no_grad():
            l64, l32 = model(ids, ids), model(ids.int(), ids)
            one = model(ids[:1, :1])
        check(f"int32 ids (fused={fused})", torch.equal(l64, l32), f"{float(l64)} vs {float(l32)}")
        check(f"one token (fused={fused})", one.shape == (1, 1, 4096) and bool(torch.isfinite(one).all()))
    return done


def main(argv: list) -> int:
    if len(argv) >= 2 and argv[0] == "verify":
        from ..atomic import atomic_write_text

        def save(res: dict) -> None:
            atomic_write_text(Path(argv[1]), json.dumps(res, indent=2) + "\n")

        res = verify(argv[2] if len(argv) > 2 else "cuda", save=save)
        save(res)
        print(f"verify: {res['cases_checked']} cases, {'ok' if res['ok'] else 'FAILED'}: {res['failures'][:5]}")
        return 0 if res["ok"] else 1
    if len(argv) in (2, 3) and argv[0] == "report":
        from .gpu_report import report

        print(report(Path(argv[1]), Path(argv[2]) if len(argv) == 3 else None))
        return 0
    if len(argv) == 2 and argv[0] == "preflight":
        from .gpu_preflight import main as preflight_main
        return preflight_main(argv[1])
    if len(argv) >= 2 and argv[0] in ("engine", "resume", "resume_dropout", "fused_compile", "cp_ring",
                                               "memcheck", "eval_generate"):
        from . import gpu_stages
        return gpu_stages.main(argv[0], argv[1:])
    if len(argv) >= 2 and argv[0] in ("profile", "kernels_roofline", "float8"):
        from . import gpu_perf_stages
        return gpu_perf_stages.main(argv[0], argv[1:])
    print("usage: python -m megafixed.bench.gpu_check verify OUT.json [cuda|cpu] | preflight OUT.json | "
          "engine OUT.json | resume OUT.json DIR | resume_dropout OUT.json DIR | fused_compile OUT.json | "
          "cp_ring OUT.json DIR | memcheck OUT.json | eval_generate OUT.json RUN | "
          "profile OUT.json DIR | kernels_roofline OUT.json MEASURED.json DIR | float8 OUT.json DIR | "
          "report DIR [OUT_DIR]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
