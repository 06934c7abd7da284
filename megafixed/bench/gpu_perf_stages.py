"""The GPU check's stages for what a user opens when a run is slow (``tools/gpu_check.sh``; not with
``--quick``). Each writes one JSON (``summary``: what was compared, what came out) and exits 1 when a
check fails:

* ``profile OUT.json DIR``: a short run with ``profile.steps`` and ``profile.memory_snapshot=true``: the
  trace of each rank is read back as JSON and must hold the window's steps and (on CUDA) GPU kernels; the
  memory snapshot must unpickle and render with PyTorch's memory viz (``torch.cuda._memory_viz``);
* ``kernels_roofline OUT.json MEASURED.json DIR``: the token-code kernel's measured time per token (the
  ``kernels_forward`` stage's JSON, or a small sweep of its own when that is missing) against the
  compile-only roofline of this GPU's architecture (``megafixed bench kernels --compile-only --json``: the
  bytes each token must move over the data-sheet bandwidth): the share of the roofline reached; a kernel
  faster than its roofline means the byte count is wrong, and fails;
* ``float8 OUT.json DIR``: the torch engine in bf16 and with ``train.float8=tensorwise`` (torchao, compiled),
  the same seed and data: tokens/s of each and the loss after N steps, which must agree within
  ``FLOAT8_LOSS_RTOL``.

A dry run on CPU: GPU_CHECK_PRECISION=fp32 and GPU_CHECK_EXTRA (``gpu_stages.py``) shrink the runs.
"""
from __future__ import annotations

import json
import pickle
import statistics
import subprocess
import sys
from pathlib import Path

from . import gpu_stages

PROFILE_STEPS = (3, 4)  # after the first steps' allocator warm-up and compilation
FLOAT8_STEPS = 30
FLOAT8_LOSS_RTOL = 0.03  # mean loss of the last 5 steps; float8's rounding moves it well under 1% at 30 steps
FLOAT8_MODEL = ["model.d_model=2048", "model.n_layers=4", "model.n_heads=16", "model.max_seq_len=512",
                "data.seq_len=512", "train.micro_batch=8", "train.global_batch=8", "schedule.warmup_steps=5"]
ROOFLINE_SLACK = 1.10  # measured faster than the roofline by more than this: the byte count is wrong


def profile(root: Path) -> dict:
    import torch

    first, last = PROFILE_STEPS
    said: list = []
    run_dir = root / "profile_run"
    _, result = gpu_stages._train([f"train.precision={gpu_stages.PRECISION}", f"train.max_steps={last + 1}",
                                   "checkpoint.interval=1000", f"profile.steps={first}-{last}",
                                   "profile.memory_snapshot=true", f"train.run_dir={run_dir}"], log=said.append)
    folder = Path(result.run_dir) / "profile"
    failures, out = [], {"said": [s for s in said if s.startswith(("profile", "profile.memory_snapshot"))]}
    cuda = torch.cuda.is_available()
    trace = folder / f"rank0_steps{first}-{last}.json"
    try:
        events = json.loads(trace.read_text())["traceEvents"]
    except (OSError, ValueError, KeyError) as exc:
        failures.append(f"trace {trace}: {type(exc).__name__}: {exc}")
        events = []
    steps = sorted({e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")})
    kernels = sum(1 for e in events if e.get("cat") == "kernel")
    out.update(trace=str(trace), trace_bytes=trace.stat().st_size if trace.exists() else 0, steps=steps,
               gpu_kernels=kernels)
    if events and steps != [f"ProfilerStep#{s}" for s in range(first, last + 1)]:
        failures.append(f"the trace holds steps {steps}, not {first}-{last}")
    if cuda and events and not kernels:
        failures.append("the trace holds no GPU kernel")
    if not any(s.startswith(f"profile of steps {first}-{last}") for s in said):
        failures.append("no summary line")
    snap = folder / "rank0_memory.pickle"
    if cuda:
        try:
            with open(snap, "rb") as fh:
                data = pickle.load(fh)
            from torch.cuda import _memory_viz

            html = _memory_viz.trace_plot(data)
            out.update(snapshot=str(snap), snapshot_segments=len(data.get("segments", [])),
                       snapshot_events=sum(len(t) for t in data.get("device_traces", [])), viz_html_bytes=len(html))
            if not out["snapshot_events"]:
                failures.append("the memory snapshot recorded no allocation")
        except Exception as exc:  # noqa: BLE001 -- any failure to read it back is the finding
            failures.append(f"memory snapshot {snap}: {type(exc).__name__}: {exc}")
    else:
        out["snapshot"] = "needs CUDA: " + ("said in one line" if any("needs CUDA" in s for s in said) else "NOT said")
        if "NOT said" in out["snapshot"]:
            failures.append("the CPU run did not say that the memory snapshot needs CUDA")
    return {"bench": "profile", **out, "failures": failures,
            "summary": {"ok": not failures, "failures": failures, "steps": steps, "gpu_kernels": kernels,
                        "snapshot_events": out.get("snapshot_events"), "line": (out["said"] or [""])[-1][:300]}}


def _cli(args: list, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megafixed.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _arch() -> str:
    import torch

    if not torch.cuda.is_available():
        return "sm_90"  # a dry run: the H100's table
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major * 10 + minor}"


def compare(measured: dict, compiled: dict, arch: str) -> tuple[list, list]:
    """Rows of (measured token-code kernel, its compile-only twin at ``arch``): the roofline reached."""
    names = {"bfloat16": "bf16", "float32": "fp32"}
    table = {(r["kernel"], r["variant"], r["arch"]): r for r in compiled.get("rows", [])}
    rows, failures = [], []
    for m in measured.get("rows", []):
        kind = {"megafixed-canonical": "canonical", "megafixed-gf2": "gf2"}.get(m.get("provider"))
        if kind is None or m.get("mode") != "forward" or m.get("dtype") not in names:
            continue
        twin = next((table[k] for ids in ("int64", "int32") for k in [(
            "_token_codes_kernel", f"{names[m['dtype']]} ids={ids} {kind} d={m['width']}", arch)] if k in table), None)
        if twin is None or twin.get("roofline_ns_per_token") is None:
            continue
        ns = m["ms_50"] * 1e6 / m["n_tokens"]
        row = {"provider": m["provider"], "dtype": m["dtype"], "width": m["width"], "n_tokens": m["n_tokens"],
               "measured_ns_per_token": ns, "measured_gbps": m["gbps"], "roofline_ns_per_token":
               twin["roofline_ns_per_token"], "roofline_share": twin["roofline_ns_per_token"] / ns,
               "bytes_per_token": twin["bytes_per_token"], "measured_bytes_per_token": m["bytes"] / m["n_tokens"],
               "registers": twin["registers"], "store_bits": twin["store_bits"]}
        rows.append(row)
        if row["roofline_share"] > ROOFLINE_SLACK:
            failures.append(f"{m['provider']} {m['dtype']} d={m['width']} n={m['n_tokens']}: measured "
                            f"{ns:.4f} ns/token, under the roofline's {twin['roofline_ns_per_token']:.4f}: the "
                            f"bytes per token ({twin['bytes_per_token']}) are wrong")
    return rows, failures


def kernels_roofline(measured_json: Path, root: Path) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    arch, failures, out = _arch(), [], {}
    compiled_json = root / "kernels_compile_only.json"
    proc = _cli(["bench", "kernels", "--compile-only", "--arch", arch, "--json", str(compiled_json), "--overwrite"],
                timeout=120)
    if not compiled_json.exists():  # this megafixed has no compile-only table, or it could not compile
        skipped = f"no compile-only table (exit {proc.returncode}): {(proc.stdout + proc.stderr).strip()[-300:]}"
        return {"bench": "kernels_roofline", "skipped": skipped, "failures": [],
                "summary": {"ok": True, "skipped": skipped}}
    compiled = json.loads(compiled_json.read_text())
    failures += [f"compile-only: {p}" for p in compiled.get("problems", [])]
    if not measured_json.exists():  # kernels_forward did not run: a sweep of its own, the paper's width
        measured_json = root / "kernels_measured.json"
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        proc = _cli(["bench", "kernels", "--device", device, "--mode", "forward", "--dtype", "bfloat16,float32",
                     "--tokens", "256k,1m" if device == "cuda" else "4k", "--width", "2048",
                     "--providers", "megafixed-canonical,megafixed-gf2", "--warmup", "5", "--rep", "20",
                     "--json", str(measured_json), "--overwrite"], timeout=120)
        out["measured_by_this_stage"] = True
        if not measured_json.exists():
            failures.append(f"bench kernels exited {proc.returncode}: {(proc.stdout + proc.stderr).strip()[-300:]}")
    measured = json.loads(measured_json.read_text()) if measured_json.exists() else {}
    rows, bad = compare(measured, compiled, arch)
    failures += bad
    if measured and not rows:
        failures.append(f"no measured token-code row has a compile-only twin at {arch}")
    best = max(rows, key=lambda r: r["roofline_share"], default=None)
    return {"bench": "kernels_roofline", "arch": arch, "rows": rows, **out, "failures": failures,
            "summary": {"ok": not failures, "failures": failures, "arch": arch, "rows": len(rows),
                        "best_roofline_share": best and best["roofline_share"],
                        "best": best and f"{best['provider']} {best['dtype']} d={best['width']} "
                                         f"n={best['n_tokens']}"}}


def float8(root: Path, save=None) -> dict:
    out: dict = {}
    failures: list = []

    def summary() -> dict:
        speed = {n: r["tokens_per_s"] for n, r in out.items()}
        return {"ok": not failures and len(out) == 2, "failures": failures, "tokens_per_s": speed,
                "speedup": speed["float8"] / speed["bf16"] if len(speed) == 2 and speed["bf16"] else None,
                "final_loss": {n: r["final_loss"] for n, r in out.items()}}

    for name, keys in (("bf16", []), ("float8", ["train.float8=tensorwise"])):
        losses, result = gpu_stages._train(
            [*FLOAT8_MODEL, "train.engine=torch", "train.compile=true", f"train.precision={gpu_stages.PRECISION}",
             f"train.max_steps={FLOAT8_STEPS}", "checkpoint.interval=1000", f"train.run_dir={root}/float8_{name}",
             *keys], mock=False)
        curve = [losses[k] for k in sorted(losses)]
        speeds = [r["tokens_per_s"] for r in result.history if "tokens_per_s" in r and r["step"] > 5]
        out[name] = {"losses": curve, "final_loss": statistics.fmean(curve[-5:]),
                     "tokens_per_s": statistics.median(speeds) if speeds else None}
        if save is not None:  # after each run: a stage stopped at its limit keeps the bf16 numbers
            save({"bench": "float8", **out, "failures": failures, "complete": False, "summary": summary()})
    a, b = out["bf16"]["final_loss"], out["float8"]["final_loss"]
    if not abs(b - a) <= FLOAT8_LOSS_RTOL * abs(a):
        failures.append(f"float8's loss after {FLOAT8_STEPS} steps {b:.4f} vs bf16's {a:.4f}: more than "
                        f"{FLOAT8_LOSS_RTOL:.0%} apart")
    return {"bench": "float8", **out, "failures": failures, "complete": True, "summary": summary()}


def main(name: str, args: list) -> int:
    from ..atomic import atomic_write_text

    out = Path(args[0])

    def save(res: dict) -> None:
        atomic_write_text(out, json.dumps(res, indent=2, default=str) + "\n")

    if name == "profile":
        res = profile(Path(args[1]))
    elif name == "kernels_roofline":
        res = kernels_roofline(Path(args[1]), Path(args[2]))
    else:
        res = float8(Path(args[1]), save=save)
    save(res)
    print(json.dumps(res.get("summary", {}), default=str)[:2000])
    return 1 if res.get("failures") else 0
