"""``megafixed bench cp CONFIG [overrides]``: what context parallelism buys on this machine -- activation
memory per rank and tokens/s against sequence length, at each cp, as ratios to cp 1 in the same run.

For each cp (``--cp 1,2,4``) one world of ``cp`` ``cp_worker`` processes (the torch engine, Ulysses over
cp ranks, dp 1; started with torchrun's environment variables) runs every sequence length (``--seq-lens``) of the
config in turn, on synthetic tokens:

* **memory**: one rank's peak by part over the engine's own build and two ``train_step``s, counted by
  the tracker ``megafixed plan --fake`` uses (``engine/native/fake_measure.measure_step``, here on real
  tensors and a real gloo group); ``activation_bytes`` is its ACT part at the peak (what autograd
  saved), ``temp_bytes`` its transients, beside the plan's analytic activations
  (``parallel.memory.estimate``) for the same layout;
* **speed**: a fresh build, ``--warmup-steps`` untimed steps, then the median of ``--steps`` timed ones;
  ``tokens_per_s`` = the global batch's tokens (every cp rank works on the same sequences) / that.

Both ratios (``*_vs_cp1``) are against cp 1's row of the same sequence length in this run. On a CPU
the cp ranks share the machine's cores, so tokens/s says what the all-to-alls cost there, not what a
GPU node would do.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HELP = "context parallelism: activation memory per rank and tokens/s vs sequence length at each cp, vs cp 1"


def _ints(text: str) -> list[int]:
    from ..config import ConfigError

    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ConfigError(f"{text!r} must be a comma-separated list of positive integers, like 1,2,4")
    return out


def add_arguments(p):
    p.add_argument("config", help="YAML run config (examples/configs/*.yaml): its model, on synthetic tokens")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.add_argument("--cp", default="1,2,4", help="context-parallel sizes, one launch each (default 1,2,4)")
    p.add_argument("--seq-lens", default="256,512,1024", help="sequence lengths (default 256,512,1024)")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps per row (default 5)")
    p.add_argument("--warmup-steps", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--json", type=Path, default=None, help="write the result as JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")


def _launch(spec: dict, cp: int, workdir: Path) -> list:
    """One world of ``cp`` worker processes, started as torchrun would (its environment variables), without
    torchrun's agent process: a benchmark's world needs no restarts."""
    from .startup_common import _env, _free_port

    spec_file, out_file = workdir / f"cp{cp}.json", workdir / f"cp{cp}.out.json"
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "megafixed.bench.cp_worker", str(spec_file), str(out_file)]
    world = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(cp))
    procs = [subprocess.Popen(cmd, env=dict(world, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(cp)]
    logs = [p.communicate()[0] for p in procs]
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
    if failed or not out_file.exists():
        r, code = failed[0] if failed else (0, 0)
        raise RuntimeError(f"bench cp: rank {r} of the cp {cp} world failed ({code}):\n{logs[r][-3000:]}")
    return json.loads(out_file.read_text())


def with_ratios(rows: list) -> list:
    """Each row with its activation bytes and tokens/s as ratios to cp 1's row of the same length."""
    base = {r["seq_len"]: r for r in rows if r["cp"] == 1}
    for r in rows:
        ref = base.get(r["seq_len"])
        r["activation_vs_cp1"] = r["activation_bytes"] / ref["activation_bytes"] if ref else None
        r["peak_vs_cp1"] = r["peak_bytes"] / ref["peak_bytes"] if ref else None
        r["tokens_per_s_vs_cp1"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None
    return rows


def run(args) -> int:
    from ..config import ConfigError, load_config
    from ..outputs import claim_output

    cps, seqs = _ints(args.cp), _ints(args.seq_lens)
    if args.steps < 1 or args.warmup_steps < 0:
        raise ConfigError("--steps must be >= 1 and --warmup-steps >= 0")
    if args.json is not None:
        claim_output([args.json], overwrite=args.overwrite, what="benchmark output")
    cfg = load_config(args.config, args.overrides)  # a bad config or override: its one line, before any launch
    spec = {"config": args.config, "overrides": list(args.overrides), "seq_lens": seqs, "steps": args.steps,
            "warmup_steps": args.warmup_steps}
    started, load = time.time(), os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="megafixed-bench-cp-") as tmp:
        for cp in cps:
            rows += _launch(spec, cp, Path(tmp))
    m = cfg.model
    out = {"bench": "cp", "config": args.config, "overrides": list(args.overrides), "cp": cps, "seq_lens": seqs,
           "model": {"d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads, "vocab_size": m.vocab_size},
           "cp_method": "ulysses", "engine": "torch", "device": "cpu", "steps": args.steps,
           "cpus": os.cpu_count(), "load_before": list(load), "load_after": list(os.getloadavg()),
           "seconds": time.time() - started, "rows": with_ratios(rows)}
    print(f"{'cp':>3} {'seq':>6} | {'activ MiB':>10} {'vs cp1':>7} {'analytic':>9} | {'peak MiB':>9} | "
          f"{'tokens/s':>9} {'vs cp1':>7}")
    for r in out["rows"]:
        print(f"{r['cp']:>3} {r['seq_len']:>6} | {r['activation_bytes'] / 2**20:10.2f} "
              f"{_ratio(r['activation_vs_cp1'])} {r['analytic_activation_bytes'] / 2**20:9.2f} | "
              f"{r['peak_bytes'] / 2**20:9.2f} | "
              f"{r['tokens_per_s']:9.0f} {_ratio(r['tokens_per_s_vs_cp1'])}")
    if args.json is not None:
        from ..atomic import atomic_write_text

        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps(out, indent=2) + "\n")
    return 0


def _ratio(x) -> str:
    return f"{x:7.3f}" if x is not None else f"{'-':>7}"
