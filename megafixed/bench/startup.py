"""``megafixed bench startup``: what a training process costs before and around its first step.

Each case is a fresh process (or a torchrun launch) doing the least a user would run; the baseline is
``python -c "import torch"``, measured in the same run. Cases (``--cases``, default all):

* ``import_torch``: the baseline;
* ``deepspeed``, ``torch``: a 1-step single-process ``megafixed train`` of a tiny model on mock data
  with ``train.engine`` set to that engine;
* ``deepspeed_tp2``, ``torch_tp2``: the same under ``torchrun --nproc-per-node 2`` with
  ``parallel.tp=2`` (every rank pays its own start-up; the two ranks share the machine's cores).

Cases alternate in ``--rounds`` rounds (default 3) so that every case sees the same load; the result per
case is the median wall time and the median CPU time (user + system of the process tree, from
``resource.getrusage(RUSAGE_CHILDREN)``), and each one's ratio to the baseline's median. The CPU ratio
is the steadier figure on a shared machine. The JSON also records the load average before and after.

``--world 2,8,16,32`` measures how start-up scales instead (``world.py``): a 4-step torch-engine run
of the tiny model at each world size on this one machine (gloo), timed phase by phase -- imports,
rendezvous, build, first step, the rest -- from the moment each phase's log line arrives, with the
log's length, against the smallest world measured in the same run.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .startup_common import TINY, _env, _free_port

HELP = ("start-up cost of a 1-step training run per engine (and TP2 under torchrun), as ratios to `import torch`; "
        "--world 2,8,16,32: rendezvous, build and first step by world size")

BASELINE = "import_torch"
CASES = {  # name -> (ranks, train overrides); ranks 0: the baseline
    BASELINE: (0, ()),
    "deepspeed": (1, ("train.engine=deepspeed",)),
    "torch": (1, ("train.engine=torch",)),
    "deepspeed_tp2": (2, ("train.engine=deepspeed", "parallel.tp=2")),
    "torch_tp2": (2, ("train.engine=torch", "parallel.tp=2")),
}


def add_arguments(p):
    p.add_argument("--world", default=None, metavar="LIST",
                   help="comma-separated world sizes (e.g. 2,8,16,32): time rendezvous, build and the first step of a "
                        "4-step torch-engine run at each (CPU, gloo, this machine) instead of the cases")
    p.add_argument("--layout", choices=("3d", "dp"), default="3d",
                   help="with --world: 3d = tp 2 x pp 2 x dp world/4 from 4 ranks on (dp below), dp = dp world")
    p.add_argument("--cases", default=",".join(CASES), metavar="LIST",
                   help=f"comma-separated cases (default: all: {', '.join(CASES)}); {BASELINE} is always measured")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are taken (default 3)")
    p.add_argument("--json", type=Path, default=None, help="write the result as JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")


def command(case: str, run_dir: Path) -> list[str]:
    """The command line of one case (``run_dir`` must not exist yet: the run creates it)."""
    ranks, extra = CASES[case]
    if ranks == 0:
        return [sys.executable, "-c", "import torch"]
    train = ["-m", "megafixed.cli", "train", "/dev/null", *TINY, f"train.run_dir={run_dir}", *extra]
    if ranks == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}", *train]


def time_once(case: str, workdir: Path, index: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process tree) of one run of ``case``."""
    cmd = command(case, workdir / f"{case}_{index}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"bench startup: case {case} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def measure(cases: list[str], rounds: int, workdir: Path) -> dict:
    samples = {case: {"wall_s": [], "cpu_s": []} for case in cases}
    load_before = os.getloadavg()
    for r in range(rounds):
        for case in cases:
            wall, cpu = time_once(case, workdir, r)
            samples[case]["wall_s"].append(round(wall, 3))
            samples[case]["cpu_s"].append(round(cpu, 3))
    base = samples[BASELINE]
    base_wall, base_cpu = statistics.median(base["wall_s"]), statistics.median(base["cpu_s"])
    out = {}
    for case, s in samples.items():
        wall, cpu = statistics.median(s["wall_s"]), statistics.median(s["cpu_s"])
        out[case] = dict(s, median_wall_s=round(wall, 3), median_cpu_s=round(cpu, 3),
                         ratio_wall=round(wall / base_wall, 3), ratio_cpu=round(cpu / base_cpu, 3),
                         ranks=CASES[case][0])
    return {"baseline": BASELINE, "rounds": rounds, "cases": out,
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}


def report_lines(result: dict) -> list[str]:
    lines = [f"start-up, median of {result['rounds']} rounds (load average {result['loadavg_before'][0]:.1f} -> "
             f"{result['loadavg_after'][0]:.1f}, {result['cpus']} CPUs); ratios against `import torch`:"]
    for case, row in result["cases"].items():
        lines.append(f"  {case:<14} wall {row['median_wall_s']:6.2f} s ({row['ratio_wall']:.2f}x)   "
                     f"cpu {row['median_cpu_s']:6.2f} s ({row['ratio_cpu']:.2f}x)")
    return lines


def run(args) -> int:
    from ..config import ConfigError
    from ..outputs import claim_output

    if args.world is not None:
        from .startup_world import run_worlds

        return run_worlds(args)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ConfigError(f"--cases: unknown case {unknown[0]!r}; choose from {', '.join(CASES)}")
    if args.rounds < 1:
        raise ConfigError(f"--rounds {args.rounds} must be >= 1")
    cases = [BASELINE] + [c for c in cases if c != BASELINE]
    if args.json is not None:
        claim_output([args.json], overwrite=args.overwrite, what="benchmark output")
    with tempfile.TemporaryDirectory(prefix="megafixed-bench-startup-") as tmp:
        result = measure(cases, args.rounds, Path(tmp))
    print("\n".join(report_lines(result)))
    if args.json is not None:
        from ..atomic import atomic_write_text

        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    return 0
