"""The GPU check's end-to-end stages (``tools/gpu_check.sh``; never part of the test suite, which has no GPU).

Each writes one JSON (``summary`` says what was compared and what came out) and exits 1 when a check fails:

* ``engine OUT.json``: bf16 through the DeepSpeed engine, a small canonical model unfused and fused
  (losses must agree to bf16 accuracy) and a gf2 model; every loss finite (mock tokens are uniform, so
  the loss stays near ln V: no learning is asked for);
* ``resume OUT.json DIR``: on the bundled corpus, an uninterrupted run against one stopped at a checkpoint
  and resumed, with a sync and with an async checkpoint, then the same for the torch engine (DCP, a
  shorter run: its three runs cost about one of DeepSpeed's, so the stage keeps its time): every resumed
  loss curve must equal its uninterrupted one exactly (same kernels, same order, same data); DIR keeps
  the runs (eval/generate use one);
* ``resume_dropout OUT.json DIR``: the same with ``model.dropout=0.1`` (DeepSpeed sync and the torch engine,
  shorter): dropout is what a step draws from the CUDA RNG, so a wrong save or restore of it shows only here;
* ``fused_compile OUT.json``: the fused first layer (gf2) on the torch engine with ``train.compile=true``
  against the same run eager (losses within bf16 accuracy): Dynamo over the kernels' autograd.Functions;
* ``cp_ring OUT.json DIR``: ring attention (``parallel.cp_method=ring``, torch's ``context_parallel``) at CP2
  against CP1, two processes in one torchrun launch (``gpu_cp_ring.py``): loss and gradient norm within 1e-5
  in fp32, 1e-3 in bf16, load-balanced and not, GQA, the fused first layer with activation checkpointing.
  Two GPUs: NCCL; one GPU: both processes on it over gloo, or skipped saying why where gloo cannot;
* ``memcheck OUT.json``: ``compute-sanitizer --tool memcheck`` on the three Triton kernels (token codes,
  the fused residual add, the fused QKV product) at a ragged shape; skipped, saying why, where the tool is
  missing or the machine refuses it;
* ``eval_generate OUT.json RUN``: ``megafixed eval`` (LAMBADA-style last-word accuracy on passages of the
  bundled corpus: real text, no download) and ``megafixed generate`` on CUDA, from RUN's checkpoint.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

QUICKSTART = Path(__file__).resolve().parents[1] / "bundled" / "quickstart.yaml"
QUIET = ["metrics.tensorboard=false", "validation.interval=0", "metrics.interval=1"]


def _train(overrides: list, *, mock: bool = True, log=None):
    """``megafixed train`` in this process (one DeepSpeed import for every run of a stage); its history.
    ``log``: what the run says (default: nothing)."""
    from ..config import load_config
    from ..data.prepare import prepare_data
    from ..parallel import setup_distributed
    from ..run_plan import RunPlan
    from ..train.trainer import train

    cfg = load_config(str(QUICKSTART), (["data.mock=true"] if mock else []) + QUIET + overrides + EXTRA)
    topo = setup_distributed(RunPlan.for_launch(cfg))
    cfg = prepare_data(cfg, is_main=True)
    result = train(cfg, topo, log=log or (lambda *_: None))
    return {r["step"]: r["loss"] for r in result.history if "loss" in r}, result


# A dry run of these stages' logic on a CPU: GPU_CHECK_PRECISION=fp32 and GPU_CHECK_EXTRA="model.d_model=64 ..."
# (overrides appended to every run). Neither is set by tools/gpu_check.sh.
PRECISION = os.environ.get("GPU_CHECK_PRECISION", "bf16")
EXTRA = os.environ.get("GPU_CHECK_EXTRA", "").split()


def engine() -> dict:
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("canonical_unfused", ["model.input=canonical", "model.fused_first_layer=false"]),
                            ("canonical_fused", ["model.input=canonical", "model.fused_first_layer=true"]),
                            ("gf2_fused", ["model.input=gf2", "model.fused_first_layer=true"])):
            losses, _ = _train(extra + [f"train.precision={PRECISION}", "train.max_steps=12",
                                        "checkpoint.interval=1000", f"train.run_dir={tmp}/{name}"])
            runs[name] = [losses[k] for k in sorted(losses)]
    a, b = runs["canonical_unfused"], runs["canonical_fused"]
    rel = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    failures = [f"{n}: non-finite loss" for n, v in runs.items() if not all(math.isfinite(x) for x in v)]
    if rel > 2e-2:
        failures.append(f"fused vs unfused bf16 losses differ by {rel:.2e} (relative) > 2e-2")
    return {"bench": "engine_bf16", "losses": runs, "fused_vs_unfused_max_rel": rel, "failures": failures,
            "summary": {"fused_vs_unfused_max_rel": rel, "final": {n: v[-1] for n, v in runs.items()},
                        "ok": not failures, "failures": failures}}


# (name, engine overrides, steps, the step it is stopped at, async save): DeepSpeed sync and async, and the
# torch engine (DCP), shorter so that the stage keeps its time
RESUMES = (("sync", ["train.engine=deepspeed"], 16, 8, False),
           ("async", ["train.engine=deepspeed"], 16, 8, True),
           ("torch", ["train.engine=torch"], 8, 4, False))


# The same comparison with dropout on: the only draws a step takes from the CUDA RNG, so a checkpoint
# that saved or restored the CUDA generator wrongly shows here (with dropout 0 nothing reads it).
DROPOUT_RESUMES = (("dropout_deepspeed", ["train.engine=deepspeed"], 6, 3, False),
                   ("dropout_torch", ["train.engine=torch"], 6, 3, False))
DROPOUT = ["model.dropout=0.1"]


def resume(root: Path, runs: tuple = RESUMES, extra: tuple = ()) -> dict:
    out, failures, refs = {}, [], {}
    for mode, engine_keys, steps, cut, async_save in runs:
        # decay_steps fixed: otherwise the schedule follows train.max_steps, and the first half would differ
        common = [*engine_keys, f"train.precision={PRECISION}", f"checkpoint.interval={cut}",
                  "model.fused_first_layer=true", f"schedule.decay_steps={steps}", "schedule.warmup_steps=4", *extra]
        key = (tuple(engine_keys), steps)
        if key not in refs:  # one uninterrupted run per engine and length
            refs[key], _ = _train(common + [f"train.max_steps={steps}", f"train.run_dir={root}/reference_{mode}"],
                                  mock=False)
            out[f"reference_{mode}"] = refs[key]
        ref = refs[key]
        run = [*common, f"checkpoint.async_save={'true' if async_save else 'false'}", f"train.run_dir={root}/{mode}"]
        first, _ = _train(run + [f"train.max_steps={cut}"], mock=False)
        second, result = _train(run + [f"train.max_steps={steps}"], mock=False)
        curve = {**first, **second}
        diff = [k for k in range(1, steps + 1) if curve.get(k) != ref.get(k)]
        out[mode] = {"engine": engine_keys[0].split("=", 1)[1], "resumed_from": result.resumed_from, "losses": curve,
                     "steps_differing": diff, "steps": steps, "resumed_at": cut}
        if result.resumed_from is None:
            failures.append(f"{mode}: the second run did not resume")
        if diff:
            failures.append(f"{mode}: the resumed loss curve differs from the uninterrupted one at steps {diff[:5]}")
    return {"bench": "resume", **out, "failures": failures,
            "summary": {"ok": not failures, "failures": failures,
                        "runs": {m: {"engine": out[m]["engine"], "steps": out[m]["steps"], "resumed_at":
                                     out[m]["resumed_at"], "exact": not out[m]["steps_differing"]}
                                 for m, *_ in runs}}}


def resume_dropout(root: Path) -> dict:
    """``resume`` with ``model.dropout`` > 0 (``DROPOUT_RESUMES``): the CUDA RNG's save and restore."""
    return {**resume(root, DROPOUT_RESUMES, tuple(DROPOUT)), "bench": "resume_dropout"}


# The fused first layer compiled: Dynamo traces its autograd.Functions (a device guard, an lru-cached
# row table, the Triton launches) on CUDA, which the CPU suite cannot (there it traces the torch path).
FUSED_COMPILE = ["train.engine=torch", "model.fused_first_layer=true", "model.input=gf2", "train.max_steps=8",
                 "checkpoint.interval=1000"]


def fused_compile() -> dict:
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, compiled in (("eager", False), ("compiled", True)):
            losses, _ = _train(FUSED_COMPILE + [f"train.precision={PRECISION}",
                                                f"train.compile={'true' if compiled else 'false'}",
                                                f"train.run_dir={tmp}/{name}"])
            runs[name] = [losses[k] for k in sorted(losses)]
    a, b = runs["eager"], runs["compiled"]
    failures = [f"{n}: non-finite loss" for n, v in runs.items() if not all(math.isfinite(x) for x in v)]
    if len(a) != len(b) or not a:
        failures.append(f"the runs logged {len(a)} and {len(b)} losses")
    rel = max((abs(x - y) / abs(x) for x, y in zip(a, b)), default=float("nan"))
    if rel > 2e-2:  # Inductor fuses and reorders the rest of the model: bf16 accuracy, as the engine stage
        failures.append(f"compiled vs eager losses differ by {rel:.2e} (relative) > 2e-2")
    return {"bench": "fused_compile", "losses": runs, "compiled_vs_eager_max_rel": rel, "failures": failures,
            "summary": {"compiled_vs_eager_max_rel": rel, "ok": not failures, "failures": failures}}


def cp_ring(root: Path, method: str = "ring", device: str = "cuda", cases: str = "", timeout_s: float = 80) -> dict:
    """``gpu_cp_ring.py`` under ``torchrun --nproc-per-node 2`` (one launch: every case in one world);
    its ``cp_ring.json``, or what the launch said when it wrote none."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cp_ring.json").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megafixed.bench.gpu_cp_ring", str(root), "--method", method, "--device", device]
    # In the stage's process group (the script's timeout stops the whole group); past its own time, torchrun is
    # asked to stop (it stops its workers), then killed.
    proc = subprocess.Popen(cmd + (["--cases", cases] if cases else []), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            text = proc.communicate(timeout=15)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            text = proc.communicate()[0]
        text += f"\n(stopped after {timeout_s} s)"
    print(text[-3000:])
    out = root / "cp_ring.json"
    if not out.exists():
        why = f"the torchrun launch exited {proc.returncode} without a result: {text.strip()[-800:]}"
        return {"bench": "cp_ring", "failures": [why], "summary": {"ok": False, "failures": [why]}}
    res = json.loads(out.read_text())
    if proc.returncode and not res["failures"]:  # a rank other than 0 failed after rank 0 wrote
        res["failures"] = [f"torchrun exited {proc.returncode}: {text.strip()[-800:]}"]
        res["summary"] = {**res["summary"], "ok": False, "failures": res["failures"]}
    return res


MEMCHECK_SCRIPT = """
import torch
from megafixed.codes import FixedCode
from megafixed.kernels import token_codes
from megafixed.kernels.fused_first_layer import add_code, code_qkv, fold, norm_alpha
code = FixedCode.gf2(16, seed=3, scale=0.1)
ids = torch.randint(0, 1 << 16, (3, 333), device="cuda")
x = token_codes(ids, code, 1000, torch.bfloat16, force_kernel=True)
y = add_code(torch.randn(3, 333, 1000, device="cuda", dtype=torch.bfloat16), ids, code, force_kernel=True)
f = fold(torch.randn(300, 1000, device="cuda"), 16)
q = code_qkv(ids, code, f, norm_alpha(code, 1e-5, torch.float32), force_kernel=True)
torch.cuda.synchronize()
print("kernels ran", x.shape, y.shape, q.shape)
"""


def memcheck() -> dict:
    tool = shutil.which("compute-sanitizer") or next(
        (str(p) for p in (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "compute-sanitizer",)
         if p.exists()), None)
    if tool is None:
        return {"bench": "memcheck", "skipped": "compute-sanitizer not found (CUDA toolkit not installed)",
                "summary": {"skipped": "compute-sanitizer not found"}}
    proc = subprocess.run([tool, "--tool", "memcheck", "--error-exitcode", "9", sys.executable, "-c", MEMCHECK_SCRIPT],
                          capture_output=True, text=True, timeout=240)
    text = proc.stdout + proc.stderr
    refused = proc.returncode not in (0, 9) and "kernels ran" not in text
    res = {"bench": "memcheck", "tool": tool, "returncode": proc.returncode, "output_tail": text[-3000:]}
    if refused:  # e.g. "Target application terminated before first instrumented API call", driver refusal
        res["skipped"] = f"compute-sanitizer could not run here (exit {proc.returncode}): {text.strip()[-300:]}"
    res["errors_found"] = proc.returncode == 9 or "ERROR SUMMARY: 0 errors" not in text and not refused
    res["summary"] = {k: res[k] for k in ("returncode", "errors_found") } | (
        {"skipped": res["skipped"]} if refused else {})
    return res


def eval_generate(run: Path) -> dict:
    failures, out = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        with gzip.open(QUICKSTART.parent / "wiki_vital_en.jsonl.gz", "rt") as fh:
            texts = [json.loads(line)["text"] for _, line in zip(range(400), fh)]
        passages = [" ".join(t.split()[:60]) for t in texts[-40:] if len(t.split()) >= 60]
        (Path(tmp) / "lambada.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in passages))
        ev = subprocess.run([sys.executable, "-m", "megafixed.cli", "eval", str(run), "--tasks", "lambada",
                             "--data-dir", tmp, "--limit", "32", "--json", f"{tmp}/eval.json"],
                            capture_output=True, text=True, timeout=240)
        out["eval_returncode"] = ev.returncode
        if ev.returncode == 0 and Path(f"{tmp}/eval.json").exists():
            out["eval"] = json.loads(Path(f"{tmp}/eval.json").read_text())
        else:
            failures.append(f"megafixed eval exited {ev.returncode}: {(ev.stdout + ev.stderr).strip()[-400:]}")
    gen = subprocess.run([sys.executable, "-m", "megafixed.cli", "generate", str(run), "--prompt",
                          "The history of", "--max-new-tokens", "24"], capture_output=True, text=True, timeout=240)
    out["generate_returncode"], out["generated"] = gen.returncode, gen.stdout.strip()[-500:]
    if gen.returncode != 0 or not gen.stdout.strip():
        failures.append(f"megafixed generate exited {gen.returncode}: {(gen.stdout + gen.stderr).strip()[-400:]}")
    return {"bench": "eval_generate", **out, "failures": failures,
            "summary": {"ok": not failures, "failures": failures, "generated": out["generated"][:200]}}


def main(name: str, args: list) -> int:
    from ..atomic import atomic_write_text

    out = Path(args[0])
    if name == "engine":
        res = engine()
    elif name == "resume":
        res = resume(Path(args[1]))
    elif name == "resume_dropout":
        res = resume_dropout(Path(args[1]))
    elif name == "fused_compile":
        res = fused_compile()
    elif name == "memcheck":
        res = memcheck()
    elif name == "cp_ring":
        res = cp_ring(Path(args[1]))
    else:
        res = eval_generate(Path(args[1]))
    atomic_write_text(out, json.dumps(res, indent=2, default=str) + "\n")
    print(json.dumps(res.get("summary", {}), default=str)[:2000])
    bad = res.get("failures") or (name == "memcheck" and res.get("errors_found"))
    return 1 if bad else 0
