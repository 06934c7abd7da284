"""Every Triton kernel compiles for sm_80, sm_90 and sm_100 on this CPU machine, as its launcher launches it.

The interpreter (tests/test_kernel.py) accepts programs the compiler refuses; here the real compiler
runs (``triton.compile`` with a ``GPUTarget``, no driver), on the arguments the launchers' own
``*_launch`` functions build at the paper's shapes. Checked from the PTX and the bundled ``ptxas -v``:
it compiles, 0 spill bytes, and a launched paper shape stores 128-bit vectors (``st.global.v4.b32``).
The odd width (2,056, which the JIT does not specialise) must store scalars: the store check can fail.

Kept fast: one case per kernel on every arch (bf16, int64 ids, GF(2)), the fp32 canonical variants on
sm_90; the whole matrix (fp32/bf16 x int32/int64 x canonical/GF(2)) is ``megafixed bench kernels
--compile-only``. Compiles are cached per module (and by Triton on disk).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from megafixed.kernels import compile_only as co  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # pragma: no cover - the interpreter has no compiler
    pytest.skip("TRITON_INTERPRET=1: the kernels are interpreted functions", allow_module_level=True)

KERNELS = ("_token_codes_kernel", "_code_qkv_kernel", "_add_code_kernel")
EXTRA_90 = [co.token_codes_case(torch.float32, torch.int32, "canonical"),
            co.code_qkv_case(torch.float32, torch.int32, "canonical"),
            co.add_code_case(torch.float32, torch.int32, "canonical")]


@pytest.fixture(scope="module")
def reports() -> list:
    out = [co.check(case, arch) for case in co.paper_cases(full=False) for arch in co.ARCHS]
    out += [co.check(case, 90) for case in EXTRA_90]
    return out


@pytest.fixture(scope="module")
def odd_width() -> co.CompileReport:
    return co.check(co.odd_width_case(), 90)


def test_every_kernel_compiles_for_every_arch(reports):
    got = {(r.kernel, r.arch) for r in reports}
    assert got >= {(k, a) for k in KERNELS for a in co.ARCHS}
    for r in reports:
        assert 0 < r.registers <= 255, r


def test_no_kernel_spills(reports):
    assert [(r.kernel, r.variant, r.arch, r.spill_bytes) for r in reports if r.spill_bytes] == []


def test_paper_shapes_store_128_bit_vectors(reports):
    for r in reports:
        assert r.paper_shape
        assert set(r.stores) == {"st.global.v4.b32"}, (r.kernel, r.variant, r.arch, r.stores)


def test_a_width_the_jit_does_not_specialise_stores_scalars(odd_width):
    """2,056 bf16 per row: rows are 16-byte aligned, but the JIT only marks integers divisible by 16,
    so the compiler cannot prove it and stores one bf16 at a time (the cost the docstring states)."""
    assert not odd_width.paper_shape
    assert not odd_width.vectorised
    assert odd_width.stores == {"st.global.b16": 32}, odd_width.stores


def test_the_check_compiles_what_the_launcher_launches():
    """The case's launch is the launcher's: same kernel, constexprs and num_warps as a real launch takes."""
    from megafixed.codes import make_code
    from megafixed.kernels.token_codes import _block_sizes, _token_codes_kernel

    launch = co.token_codes_case(torch.bfloat16, torch.int64, "gf2").build()
    block_t, block_w, num_warps = _block_sizes(co.PAPER_WIDTH)
    assert launch.kernel is _token_codes_kernel
    assert launch.meta == dict(BITS=16, CANONICAL=False, BLOCK_T=block_t, BLOCK_W=block_w, num_warps=num_warps)
    assert launch.args[4] == co.PAPER_WIDTH and launch.args[2].dtype == torch.int16
    assert make_code("gf2", 16, seed=0).shift == launch.args[5]


def test_store_stream_parser():
    ptx = "st.global.v4.b32 [%rd1], {%r1, %r2, %r3, %r4};\n@%p1 st.global.b16 [%rd2], %rs1;\nld.global.b32 %r5;"
    assert co.store_stream(ptx) == {"st.global.v4.b32": 1, "st.global.b16": 1}
    assert co._store_bits("st.global.v4.b32") == 128 and co._store_bits("st.global.b16") == 16
    assert co._store_bits("st.global.v2.b32") == 64


def test_bench_compile_only_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "megafixed.cli", "bench", "kernels", "--compile-only", "--arch",
                          "sm_90", "--json", str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "roofline ns/token" in res.stdout and "_code_qkv_kernel" in res.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {r["kernel"] for r in rows} == set(KERNELS)
    assert {r["arch"] for r in rows} == {"sm_90"}
    assert len(rows) == 3 * 8 + 1  # the whole paper matrix and the odd width
    paper = next(r for r in rows if r["kernel"] == "_token_codes_kernel" and r["variant"].startswith("bf16 ids=int64"))
    # 2,048 bf16 written + an int64 id read, at the H100 SXM's 3.35 TB/s
    assert paper["bytes_per_token"] == 2 * 2048 + 8
    assert paper["roofline_ns_per_token"] == pytest.approx((2 * 2048 + 8) / 3.35e12 * 1e9)
    assert json.loads(out.read_text())["problems"] == []


def test_bench_compile_only_refuses_an_unknown_arch(capsys, monkeypatch):
    from megafixed.cli import main

    monkeypatch.delenv("MEGAFIXED_TRACEBACK", raising=False)  # the CLI's own refusal, in this process: no launch
    code = main(["bench", "kernels", "--compile-only", "--arch", "sm_75"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "--arch sm_75: choose from sm_80, sm_90, sm_100" in out + err
