"""``megafixed bench kernels``: byte counts, the CPU code path, a tiny sweep's JSON/CSV/PNG, and the
bit-identity gate that refuses to time a wrong kernel."""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json

import pytest
import torch

from megafixed.bench import kernels as bk
from megafixed.codes import FixedCode

INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}
LIGER_COLUMNS = ["kernel_name", "kernel_provider", "kernel_operation_mode", "metric_name", "metric_unit", "x_name",
                 "x_label", "x_value", "y_value_50", "y_value_20", "y_value_80", "extra_benchmark_config_str",
                 "gpu_name", "timestamp", "liger_version"]


def test_bytes_each_provider_must_move_by_hand():
    n, d, v = 1000, 64, 500
    # fixed code: 8-byte ids in, 1000 x 64 fp32 out = 8,000 + 256,000
    assert bk.bytes_moved("megafixed-gf2", "forward", n, d, 4, 8, v) == 264_000
    assert bk.bytes_moved("megafixed-canonical", "full", n, d, 4, 8, v) == 264_000  # no backward, no optimizer
    assert bk.bytes_moved("torch-compile", "forward", n, d, 2, 4, v) == 4_000 + 128_000
    # table forward: + the 256,000 bytes of rows read
    assert bk.bytes_moved("torch-embedding", "forward", n, d, 4, 8, v) == 520_000
    # table full: forward 520,000 + dY read 256,000 + dense V x d grad 128,000 + AdamW 7 x 128,000
    assert bk.bytes_moved("torch-embedding", "full", n, d, 4, 8, v) == 520_000 + 256_000 + 128_000 + 896_000
    assert bk.bytes_moved("liger-embedding", "full", n, d, 4, 8, v) == 1_800_000


@pytest.mark.parametrize("kind", ["canonical", "gf2_affine", "gf2_linear"])
def test_cpu_path_is_bit_identical_to_the_gather_definition(kind):
    # The definition before the fast path: round the bits-wide values, then gather column j % bits.
    gen = torch.Generator().manual_seed(1)
    for bits, scale in ((16, 1.0), (5, 0.1), (12, 2.5)):
        code = (FixedCode.canonical(bits, scale=scale) if kind == "canonical" else
                FixedCode.gf2(bits, seed=bits, affine=kind == "gf2_affine", scale=scale))
        ids = torch.randint(0, 1 << bits, (3, 41), generator=gen)
        ids[0, 0], ids[-1, -1] = 0, (1 << bits) - 1
        for width in (bits, bits + 3, 100, 2048):
            for dtype in INT_VIEW:
                values = ((code.code_bits(ids) * 2 - 1).to(torch.float32) * scale).to(dtype)
                want = values[..., torch.arange(width) % bits]
                got = code.encode(ids, width, dtype)
                assert got.shape == want.shape and got.is_contiguous()
                assert torch.equal(got.view(INT_VIEW[dtype]), want.view(INT_VIEW[dtype])), (bits, width, dtype)
    assert code.encode(torch.empty(0, 2, dtype=torch.long), 20).shape == (0, 2, 20)
    assert code.encode(torch.tensor(3), 20).shape == (20,)
    bad = torch.tensor([-7, 1 << 40])  # unvalidated ids: low bits only, as the kernel
    assert torch.equal(code.encode(bad, 20, validate=False), code.encode(bad & ((1 << bits) - 1), 20))


def _args(tmp_path, **kw):
    p = argparse.ArgumentParser()
    bk.add_arguments(p)
    argv = ["--device", "cpu", "--tokens", "256,512", "--width", "64,128", "--mode", "both", "--min-time", "0.01",
            "--json", str(tmp_path / "k.json"), "--csv", str(tmp_path / "k.csv")]
    for k, v in kw.items():
        argv += [f"--{k}", str(v)]
    return p.parse_args(argv)


def test_tiny_cpu_sweep_json_and_csv_schema(tmp_path, capsys):
    args = _args(tmp_path, vocab=1000, bits=10)
    if importlib.util.find_spec("matplotlib"):
        args.plot = tmp_path / "k.png"
    assert bk.run(args) == 0
    res = json.loads((tmp_path / "k.json").read_text())
    assert res["copy_peak"]["gbps"] > 0 and res["timer"].startswith("torch.utils.benchmark")
    provs = {"megafixed-canonical", "megafixed-gf2", "torch-embedding"}
    assert {r["provider"] for r in res["rows"]} == provs
    assert len(res["rows"]) == 2 * 2 * 2 * 3  # modes x widths x tokens x providers
    assert all(c["bit_identical"] for c in res["bit_identity"]) and len(res["bit_identity"]) == 2 * 2 * 2
    for r in res["rows"]:
        assert r["ms_20"] <= r["ms_50"] <= r["ms_80"]
        assert r["bytes"] == bk.bytes_moved(r["provider"], r["mode"], r["n_tokens"], r["width"], 4, 8, 1000)
        assert r["gbps"] == pytest.approx(r["bytes"] / (r["ms_50"] * 1e-3) / 1e9)
        assert r["pct_copy_peak"] == pytest.approx(100 * r["gbps"] / res["copy_peak"]["gbps"])
        assert r["pct_spec_peak"] is None  # no data-sheet bandwidth for a CPU
        assert r["speedup_vs_torch_embedding"] > 0
    with open(tmp_path / "k.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0])[: len(LIGER_COLUMNS)] == LIGER_COLUMNS
    assert list(rows[0])[len(LIGER_COLUMNS):] == ["bytes", "gbps", "pct_copy_peak", "pct_spec_peak"]
    assert len(rows) == len(res["rows"])
    first = rows[0]
    assert first["kernel_name"] == "token_input" and first["metric_unit"] == "ms" and first["x_name"] == "T"
    assert json.loads(first["extra_benchmark_config_str"]) == {"bits": 10, "dtype": "float32", "vocab": 1000,
                                                               "width": 64}
    assert {r["kernel_operation_mode"] for r in rows} == {"forward", "full"}
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "copy peak" in capsys.readouterr().out


def test_a_wrong_kernel_is_not_timed_and_exits_1(tmp_path, monkeypatch):
    import megafixed.kernels as mk

    real = mk.token_codes

    def off_by_one_column(ids, code, width, dtype=torch.float32, **kw):
        out = real(ids, code, width, dtype, **kw)
        out[..., -1] *= -1
        return out

    monkeypatch.setattr(mk, "token_codes", off_by_one_column)
    timed = []
    monkeypatch.setattr(bk, "_time_cpu", lambda *a, **k: timed.append(1) or bk.Timing(1.0, 1.0, 1.0))
    args = _args(tmp_path, vocab=1000, bits=10)
    assert bk.run(args) == 1
    assert len(timed) == 1  # the copy peak only: no provider was timed
    assert not (tmp_path / "k.json").exists()


def test_bad_flags_are_refused_before_timing(tmp_path):
    from megafixed.config import ConfigError

    for kw, msg in (({"providers": "liger-embedding"}, "needs CUDA"), ({"dtype": "int8"}, "--dtype int8"),
                    ({"width": 8}, "--width 8 < --bits 16"), ({"mode": "backward"}, "--mode backward")):
        with pytest.raises(ConfigError, match=msg):
            bk.run(_args(tmp_path, **kw))
