"""The GPU check's summary: ``DIR/*.json`` and ``DIR/stages.tsv`` -> ``OUT/gpu_check.json`` + ``OUT/gpu_check.md``.

Standard library only, and run as a file (``python3 megafixed/bench/gpu_report.py DIR OUT``) by
``tools/gpu_check.sh`` after every stage: importing the package would import torch (seconds, each time).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _write(path: Path, text: str) -> None:
    """Atomic: a reader (or a kill) never sees half a summary."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _fmt(x, spec=".1f", scale=1.0, suffix=""):
    return "n/a" if x is None else f"{x * scale:{spec}}{suffix}"


def _stages(folder: Path) -> list:
    """``stages.tsv`` (written by tools/gpu_check.sh): name, result (ok/timeout/failed(rc)/cut), seconds, limit."""
    f = folder / "stages.tsv"
    rows = [line.split("\t") for line in f.read_text().splitlines() if line.strip()] if f.exists() else []
    return [{"stage": r[0], "result": r[1], "seconds": int(r[2]), "limit_s": int(r[3])} for r in rows if len(r) == 4]


def _load(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as exc:  # a stage killed mid-write cannot leave this (atomic), a crash can
        return {"unreadable": f"{type(exc).__name__}: {exc}"}


def _roofline(part) -> list:
    """The token-code kernel's measured time per token against the compile-only roofline of this GPU."""
    if not part or "rows" not in part:
        return [f"**kernels_roofline**: {part.get('skipped', part)}", ""] if part else []
    lines = [f"## Kernels against the compile-only roofline ({part['arch']})", "",
             "| provider | dtype | d | tokens | ns/token | roofline ns/token | of roofline | GB/s | regs | store |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['provider']} | {r['dtype']} | {r['width']} | {r['n_tokens']:,} | "
              f"{r['measured_ns_per_token']:.4f} | {r['roofline_ns_per_token']:.4f} | {r['roofline_share']:.0%} | "
              f"{r['measured_gbps']:.0f} | {r['registers']} | {r['store_bits']} b |" for r in part["rows"]]
    return lines + ([f"Failures: {'; '.join(part['failures'])}."] if part.get("failures") else []) + [""]


def report(folder: Path, out: Path = None) -> str:
    """Merge ``folder/*.json`` into ``out/gpu_check.json`` and a markdown summary ``out/gpu_check.md``."""
    out = out or folder
    parts = {p.stem: _load(p) for p in sorted(folder.glob("*.json")) if p.name != "gpu_check.json"}
    stages = _stages(folder)
    lines = [f"# GPU check ({time.strftime('%Y-%m-%d %H:%M')})", ""]
    pre = parts.get("preflight")
    if pre:
        lines += [f"Preflight: python {pre.get('python')}, " + ", ".join(f"{k} {v}" for k, v in
                  sorted(pre.get("versions", {}).items())) + f"; DeepSpeed accelerator "
                  f"{pre.get('deepspeed_accelerator')}; device {pre.get('device_name', 'none')}"
                  + (f"; problems: {'; '.join(pre['problems'])}" if pre.get("problems") else "") + ".", ""]
    if stages:
        bad = [s for s in stages if s["result"] != "ok"]
        lines += ["| stage | result | seconds | limit |", "| --- | --- | --- | --- |"]
        lines += [f"| {s['stage']} | {s['result']} | {s['seconds']} | {s['limit_s']} |" for s in stages]
        lines += ["", ("All stages passed." if not bad else "Not passed: " + ", ".join(
            f"{s['stage']} ({s['result']})" for s in bad) + ". A benchmark stopped at its limit keeps the rows "
            "it measured (`complete: false` in its JSON)."), ""]
    for name, part in parts.items():
        if isinstance(part, dict) and part.get("complete") is False:
            what = f"{len(part['rows'])} rows measured" if "rows" in part else "the parts checked are in its JSON"
            lines.append(f"`{name}` is partial: {what} before it stopped.")
    for name in ("engine_bf16", "resume", "resume_dropout", "fused_compile", "memcheck", "eval_generate", "profile",
                 "float8"):
        if name in parts:
            lines += [f"**{name}**: " + json.dumps(parts[name].get("summary", parts[name]))[:1500], ""]
    lines += _roofline(parts.get("kernels_roofline"))
    v = parts.get("verify")
    if v:
        lines += [f"Device: {v['device_name']}; torch {v['torch']}.", "",
                  f"**Bit identity**: {v['cases_checked']} token-code cases and as many fused residual adds "
                  f"(fp32/bf16/fp16/fp64 x 4 codes at d=2,048, ragged widths, int32/int64 ids): "
                  f"{'all identical' if v['ok'] else 'FAILED: ' + '; '.join(v['failures'][:5])}.",
                  "Fused first layer, fp32: " + ", ".join(
                      f"{k} loss {m['loss_fused']:.6f} vs {m['loss_plain']:.6f}, max grad rel err "
                      f"{m['max_grad_rel_err']:.1e}" for k, m in v["fused_model_fp32"].items()) + ".",
                  "Edge cases: " + (", ".join(f"{k}: {'ok' if r is True else r}" for k, r in
                                              v.get("edge_cases", {}).items()) or "not reached") + ".", ""]
    for name, k in parts.items():
        if k.get("bench") != "kernels":
            continue
        lines += [f"## Kernel sweep `{name}` (copy peak {k['copy_peak']['gbps']:.0f} GB/s, data sheet "
                  f"{_fmt(k['spec_bandwidth_Bps'], '.0f', 1e-9)} GB/s)", "",
                  "| mode | dtype | d | tokens | provider | ms (p50) | GB/s | % copy | % spec | vs F.embedding |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in k["rows"]:
            lines.append(f"| {r['mode']} | {r['dtype']} | {r['width']} | {r['n_tokens']:,} | {r['provider']} | "
                         f"{r['ms_50']:.4f} | {r['gbps']:.0f} | {r['pct_copy_peak']:.0f}% | "
                         f"{_fmt(r['pct_spec_peak'], '.0f', 1, '%')} | "
                         f"{_fmt(r.get('speedup_vs_torch_embedding'), '.2f', 1, 'x')} |")
        lines.append("")
    trains = {n: t for n, t in parts.items() if t.get("bench") == "train"}
    if trains:
        lines += ["## Training (mock data)", "",
                  "| run | input | tokens/step | loop | step ms | tokens/s | MFU | peak memory | overhead |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for n, t in trains.items():
            # every engine the bench ran (a two-engine run keys each by name; "framework" is the first's alias)
            engines = [e for e in t.get("engines", []) if isinstance(t.get(e), dict)] or ["framework"]
            for loop in ("bare", *engines):
                if loop in t:
                    s = t[loop]
                    lines.append(f"| {n} | {t['input']} | {t['tokens_per_step']:,} | {loop} | "
                                 f"{s['step_s_median'] * 1e3:.1f} | {s['tokens_per_s']:,.0f} | "
                                 f"{_fmt(s['mfu'], '.1f', 100, '%') if s['mfu'] is not None else 'unknown'} | "
                                 f"{_fmt(s['peak_memory_bytes'], '.1f', 2 ** -30, ' GiB')} | "
                                 f"{_fmt(s.get('overhead'), '+.1f', 100, '%') if loop != 'bare' else ''} |")
        lines.append("")
    md = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "gpu_check.json", json.dumps({"stages": stages, **parts}, indent=2) + "\n")
    _write(out / "gpu_check.md", md)
    return md


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        print("usage: python3 gpu_report.py DIR [OUT_DIR]", file=sys.stderr)
        sys.exit(2)
    report(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) == 3 else None)
