"""The Triton token-code kernel against FixedCode.encode, bit for bit, on CPU.

Triton decides at decoration time whether ``@triton.jit`` builds an interpreted function, so the
kernel must be imported with ``TRITON_INTERPRET=1`` already set. Other test files may import
``megafixed.kernels`` (and so Triton) without it, so the interpreter runs happen in a subprocess:
this file re-runs itself as a worker (``python tests/test_kernel.py interp SEED``) that prints one
JSON result per case, and the parametrized tests below assert on those results.

A second worker compiles the kernel for sm_90 (no GPU needed) to prove it lowers to PTX with
128-bit stores, and a third imports the package with Triton hidden to prove it stays optional.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megafixed.codes import CodeError, FixedCode

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
# Same-width integer views: comparing these is comparing bit patterns (and tells -0.0 from 0.0).
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}
# (kind, bits, scale): scale 0.1 is not representable in bf16/fp16, so rounding is exercised.
CODES = [("canonical", 16, 1.0), ("gf2_linear", 16, 1.0), ("gf2_affine", 16, 0.1),
         ("canonical", 5, 0.1), ("gf2_linear", 5, 1.0), ("gf2_affine", 5, 1.0),
         ("canonical", 24, 1.0), ("gf2_linear", 24, 0.1), ("gf2_affine", 24, 2.5)]
WIDTHS = [16, 37, 100, 2048]


def _cases() -> list[dict]:
    """Every code x width x {fp32, bf16, fp16}; id dtype, id shape and token count rotate."""
    cases = []
    shapes = [[96], [4, 16], [256], [2, 32], [33], [3, 43]]  # 1-D and 2-D, ragged token counts
    for kind, bits, scale in CODES:
        for width in WIDTHS:
            if width < bits:
                width = bits  # 24-bit codes: the narrowest legal width stands in for 16
            for dtype in ("float32", "bfloat16", "float16"):
                i = len(cases)
                cases.append({"kind": kind, "bits": bits, "scale": scale, "width": width, "dtype": dtype,
                              "id_dtype": ("int32", "int64")[i % 2], "shape": shapes[i % len(shapes)]})
    # float64 output is outside the brief but costs one line in the kernel; keep it honest.
    cases.append({"kind": "gf2_affine", "bits": 16, "scale": 0.1, "width": 100, "dtype": "float64",
                  "id_dtype": "int64", "shape": [64]})
    return cases


CASES = _cases()


def _case_id(c: dict) -> str:
    return f"{c['kind']}-b{c['bits']}-w{c['width']}-{c['dtype']}-{c['id_dtype']}-{'x'.join(map(str, c['shape']))}"


def _make_code(kind: str, bits: int, scale: float) -> FixedCode:
    if kind == "canonical":
        return FixedCode.canonical(bits, scale=scale)
    return FixedCode.gf2(bits, seed=bits * 7 + 1, affine=kind == "gf2_affine", scale=scale)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(INT_VIEW[a.dtype]), b.contiguous().view(INT_VIEW[b.dtype]))


def _kernel_module():
    # `megafixed.kernels.token_codes` as an attribute is the function (re-exported by the package),
    # so `import megafixed.kernels.token_codes as m` would bind the function; fetch the module.
    import importlib
    return importlib.import_module("megafixed.kernels.token_codes")


# ============================================================================ subprocess workers
def _worker_interp(seed: int) -> dict:
    """Runs with TRITON_INTERPRET=1: every case through the kernel, compared with encode()."""
    from megafixed.kernels import token_codes
    from megafixed.kernels.token_codes import kernel_is_interpreted, token_codes_kernel

    out: dict = {"interpreted": kernel_is_interpreted(), "cases": {}, "extra": {}}
    gen = torch.Generator().manual_seed(seed)
    for c in CASES:
        code = _make_code(c["kind"], c["bits"], c["scale"])
        dtype = DTYPES[c["dtype"]]
        ids = torch.randint(0, 1 << c["bits"], c["shape"], generator=gen).to(getattr(torch, c["id_dtype"]))
        flat = ids.view(-1)
        flat[0], flat[-1] = 0, (1 << c["bits"]) - 1  # both ends of the id range, every case
        got = token_codes(ids, code, c["width"], dtype, force_kernel=True)
        want = code.encode(ids, c["width"], dtype)
        mism = (got.view(INT_VIEW[dtype]) != want.view(INT_VIEW[dtype])) if got.shape == want.shape else None
        out["cases"][_case_id(c)] = {
            "same_bits": _bits_equal(got, want),
            "shape": list(got.shape), "want_shape": list(want.shape), "dtype": str(got.dtype),
            "mismatches": None if mism is None else int(mism.sum()),
            "decodes": bool(torch.equal(code.decode(got.double()), ids.long())),
        }

    extra = out["extra"]
    code = _make_code("gf2_affine", 16, 1.0)
    # Empty input: no launch, right shape, for 1-D and 2-D ids.
    for shape in ([0], [3, 0]):
        e = token_codes(torch.empty(shape, dtype=torch.int64), code, 40, torch.bfloat16, force_kernel=True)
        extra[f"empty_{shape}"] = {"shape": list(e.shape), "dtype": str(e.dtype)}
    # Non-contiguous ids (a transposed view) must be read in logical order.
    ids = torch.randint(0, 1 << 16, (24, 5), generator=gen).t()
    extra["noncontiguous"] = _bits_equal(token_codes(ids, code, 48, force_kernel=True), code.encode(ids, 48))
    # validate=False: out-of-range ids are not checked; the kernel must still agree with encode,
    # which looks only at the low `bits` bits (negative int64 ids included).
    bad = torch.tensor([-5, 1 << 16, (1 << 20) + 3, -(1 << 40) + 7, 65535], dtype=torch.int64)
    extra["unvalidated"] = _bits_equal(token_codes(bad, code, 32, force_kernel=True, validate=False),
                                       code.encode(bad, 32, validate=False))
    # Validation happens in the dispatch for the kernel path too, naming the bad id.
    for name, bad_ids in (("too_big", torch.tensor([3, 70000])), ("negative", torch.tensor([-2, 3]))):
        try:
            token_codes(bad_ids, code, 32, force_kernel=True)
            extra[name] = "no error"
        except CodeError as exc:
            extra[name] = str(exc)
    # The env switch forces the kernel just like force_kernel=True (same output here).
    os.environ["MEGAFIXED_FORCE_TRITON"] = "1"
    tc = _kernel_module()
    calls = []
    real = tc.token_codes_kernel
    tc.token_codes_kernel = lambda *a, **k: calls.append(1) or real(*a, **k)
    ids = torch.randint(0, 1 << 16, (50,), generator=gen)
    extra["env_forced"] = {"same": _bits_equal(tc.token_codes(ids, code, 20), code.encode(ids, 20)),
                           "kernel_calls": len(calls)}
    tc.token_codes_kernel = real
    del os.environ["MEGAFIXED_FORCE_TRITON"]
    # Direct kernel call with an unsupported output dtype is a clear error.
    try:
        token_codes_kernel(ids, code, 20, torch.int32)
        extra["bad_dtype"] = "no error"
    except CodeError as exc:
        extra["bad_dtype"] = str(exc)
    return out


def _worker_aot() -> dict:
    """Runs WITHOUT the interpreter: lower the kernel to sm_90 PTX/cubin and inspect the stores."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megafixed.kernels import token_codes
    from megafixed.kernels.token_codes import _block_sizes, _token_codes_kernel, kernel_is_interpreted

    res: dict = {"interpreted": kernel_is_interpreted(), "variants": {}}
    block_t, block_w, num_warps = _block_sizes(2048)
    for canonical in (True, False):
        sig = {"ids_ptr": "*i64", "rows_ptr": "*i32", "out_ptr": "*i16", "n_tokens": "i32", "width": "i32",
               "shift": "i32", "pos_pattern": "i32", "neg_pattern": "i32", "BITS": "constexpr",
               "CANONICAL": "constexpr", "BLOCK_T": "constexpr", "BLOCK_W": "constexpr"}
        # What the launcher specializes for 16-aligned pointers and a width that is a multiple of 16.
        attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 4)}
        src = ASTSource(_token_codes_kernel, sig, attrs=attrs,
                        constexprs={"BITS": 16, "CANONICAL": canonical, "BLOCK_T": block_t, "BLOCK_W": block_w})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
        stores = [ln.split()[1] for ln in k.asm["ptx"].splitlines() if "st.global" in ln]
        res["variants"][str(canonical)] = {"stores": sorted(set(stores)), "cubin_bytes": len(k.asm["cubin"])}
    # Forcing the (compiled, not interpreted) kernel on CPU tensors must say how to fix it.
    try:
        token_codes(torch.tensor([1, 2]), FixedCode.canonical(16), 16, force_kernel=True)
        res["cpu_forced"] = "no error"
    except RuntimeError as exc:
        res["cpu_forced"] = str(exc)
    return res


def _worker_no_triton() -> dict:
    """Runs with ``import triton`` made to fail: the package must fall back to torch."""
    import builtins

    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton' (hidden by test)")
        return real_import(name, *args, **kwargs)

    builtins.__import__ = no_triton
    import megafixed.kernels as mk

    code = FixedCode.gf2(16, seed=5)
    ids = torch.randint(0, 1 << 16, (2, 30))
    res = {"have_triton": _kernel_module().HAVE_TRITON,
           "same": _bits_equal(mk.token_codes(ids, code, 40), code.encode(ids, 40)),
           "triton_loaded": "triton" in sys.modules}
    try:
        mk.token_codes(ids, code, 40, force_kernel=True)
        res["forced"] = "no error"
    except RuntimeError as exc:
        res["forced"] = str(exc)
    return res


def _run_worker(mode: str, *args: str, interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MEGAFIXED_FORCE_TRITON")}
    env["OMP_NUM_THREADS"] = "1"
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, __file__, mode, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"{mode} worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ============================================================================ the tests
# Triton is an optional extra: without it only the fallback tests below can run.
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
SEED = int(os.environ.get("MEGAFIXED_TEST_SEED", time.time_ns() % (1 << 31)))


@pytest.fixture(scope="module")
def interp():
    return _run_worker("interp", str(SEED), interpret=True)


@needs_triton
def test_worker_really_used_the_interpreter(interp):
    assert interp["interpreted"] is True
    assert set(interp["cases"]) == {_case_id(c) for c in CASES}


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_kernel_matches_encode_bit_for_bit(interp, case):
    r = interp["cases"][_case_id(case)]
    assert r["shape"] == r["want_shape"] == case["shape"] + [case["width"]]
    assert r["dtype"] == f"torch.{case['dtype']}"
    assert r["same_bits"], f"{r['mismatches']} elements differ from encode (seed {SEED})"
    assert r["decodes"], f"decode(kernel(ids)) != ids (seed {SEED})"


def test_kernel_coverage_is_what_the_brief_asks():
    # Guards the case list itself: trimming it for speed must not drop a dimension.
    seen = {k: {str(c[k]) for c in CASES} for k in ("kind", "bits", "width", "dtype", "id_dtype")}
    assert {"canonical", "gf2_linear", "gf2_affine"} <= seen["kind"]
    assert {"16", "5", "24"} <= seen["bits"]
    assert {"16", "37", "100", "2048"} <= seen["width"]
    assert {"float32", "bfloat16", "float16"} <= seen["dtype"]
    assert seen["id_dtype"] == {"int32", "int64"}
    assert {len(c["shape"]) for c in CASES} == {1, 2}


@needs_triton
def test_kernel_empty_input(interp):
    assert interp["extra"]["empty_[0]"] == {"shape": [0, 40], "dtype": "torch.bfloat16"}
    assert interp["extra"]["empty_[3, 0]"] == {"shape": [3, 0, 40], "dtype": "torch.bfloat16"}


@needs_triton
def test_kernel_noncontiguous_and_unvalidated_ids(interp):
    assert interp["extra"]["noncontiguous"] is True
    assert interp["extra"]["unvalidated"] is True


@needs_triton
def test_kernel_path_validates_ids(interp):
    assert "token id 70000" in interp["extra"]["too_big"]
    assert "token id -2" in interp["extra"]["negative"]


@needs_triton
def test_env_var_forces_kernel(interp):
    assert interp["extra"]["env_forced"] == {"same": True, "kernel_calls": 1}


@needs_triton
def test_kernel_rejects_unsupported_dtype(interp):
    assert "torch.int32" in interp["extra"]["bad_dtype"]


@needs_triton
def test_kernel_lowers_to_sm90_with_wide_stores():
    res = _run_worker("aot", interpret=False)
    assert res["interpreted"] is False
    for canonical, v in res["variants"].items():
        assert v["cubin_bytes"] > 0
        assert v["stores"] == ["st.global.v4.b32"], f"canonical={canonical}: stores {v['stores']} not 128-bit"
    assert "TRITON_INTERPRET=1" in res["cpu_forced"]


def test_package_works_without_triton():
    res = _run_worker("no_triton", interpret=False)
    assert res == {"have_triton": False, "same": True, "triton_loaded": False,
                   "forced": res["forced"]}
    assert "megafixed[kernels]" in res["forced"]


# ---------------------------------------------------------------------------- in-process dispatch
def test_dispatch_uses_torch_on_cpu_without_forcing(monkeypatch):
    tc = _kernel_module()

    def boom(*a, **k):
        raise AssertionError("kernel launched for a CPU tensor without forcing")

    monkeypatch.setattr(tc, "token_codes_kernel", boom)
    monkeypatch.delenv("MEGAFIXED_FORCE_TRITON", raising=False)
    code = FixedCode.gf2(16, seed=9)
    ids = torch.randint(0, 1 << 16, (3, 7))
    for dtype in (torch.float32, torch.bfloat16):
        assert _bits_equal(tc.token_codes(ids, code, 50, dtype), code.encode(ids, 50, dtype))
    assert _bits_equal(tc.token_codes_reference(ids, code, 50), code.encode(ids, 50))
    empty = tc.token_codes(torch.empty(0, dtype=torch.int64), code, 50)
    assert empty.shape == (0, 50)


def test_dispatch_torch_path_validates():
    from megafixed.kernels import token_codes

    code = FixedCode.canonical(8)
    with pytest.raises(CodeError, match="token id 256"):
        token_codes(torch.tensor([1, 256]), code, 16)
    with pytest.raises(CodeError, match="token id -1"):
        token_codes(torch.tensor([-1, 2]), code, 16)
    with pytest.raises(CodeError, match="integer tensor"):
        token_codes(torch.tensor([1.0]), code, 16)
    with pytest.raises(CodeError, match="width 4 < code bits 8"):
        token_codes(torch.tensor([1]), code, 4)
    # validate=False skips the range check (no host sync); only the low bits are used.
    out = token_codes(torch.tensor([256 + 3]), code, 8, validate=False)
    assert torch.equal(out, code.encode(torch.tensor([3]), 8))


def test_codes_carry_no_grad():
    from megafixed.kernels import token_codes

    assert not token_codes(torch.tensor([1, 2]), FixedCode.canonical(4), 8).requires_grad


if __name__ == "__main__":
    mode = sys.argv[1]
    result = {"interp": lambda: _worker_interp(int(sys.argv[2])), "aot": _worker_aot,
              "no_triton": _worker_no_triton}[mode]()
    print(json.dumps(result))
