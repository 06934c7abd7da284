"""``megafixed bench startup --world 2,8,16,32``: how a run's start-up scales with the world size.

At each world size, one ``torchrun --nproc-per-node W megafixed train`` of the tiny model on mock data
(torch engine, CPU, gloo, on this one machine), 4 steps with 2 micro batches of one sequence per
data-parallel rank (weak scaling: every rank does the same work at every size). Its phases are
timed from outside, by when rank 0's log line for each arrives (the output unbuffered):

* ``imports``: launch -> rank 0's rendezvous line (torchrun's start, every import before the meeting);
* ``rendezvous``: -> the thread-policy line (the meeting of all ranks, the process groups and mesh);
* ``build``: -> the start line (the model, its TP/PP/FSDP2, the optimizer, the resume check);
* ``first_step``: -> step 1's line; ``rest``: -> the ``done:`` line (3 steps, the final checkpoint);
* ``exit``: -> every process gone.

On one machine the ranks share its cores, so wall time grows with W even when nothing scales badly:
each phase is also given per rank of the machine's share (``wall * cores / W``, flat when a phase
costs the same per rank) and as a ratio to the smallest world's, beside the CPU seconds per rank.
The log's length (lines, warning lines, lines a non-zero rank printed) is recorded too: a 32-rank
log should be as short as a 2-rank one.
"""
from __future__ import annotations

import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARKS = (("imports", re.compile(r"^megafixed: rank 0 of \d+ on .*: rendezvous at ")),
         ("rendezvous", re.compile(r"^cpu threads: ")),
         ("build", re.compile(r"^training \S+ interface: ")),
         ("first_step", re.compile(r"^step 1/")),
         ("rest", re.compile(r"^done: ")))
WARNING_LINE = re.compile(r"Warning|WARNING|\]:W\d{4} |^warning")
PER_RANK_LINE = re.compile(r"^\[rank[1-9]\d*\]")
STEPS = 4


def layout(world: int, kind: str) -> tuple[int, int, int]:
    """(tp, pp, dp) of the benchmark's run at ``world`` ranks."""
    if kind == "3d" and world % 4 == 0:
        return 2, 2, world // 4
    return 1, 1, world


def command(world: int, kind: str, run_dir: Path, port: int) -> list[str]:
    from .startup_common import TINY

    tp, pp, dp = layout(world, kind)
    overrides = [*TINY, f"train.run_dir={run_dir}", "train.engine=torch", f"train.max_steps={STEPS}",
                 "train.micro_batch=1", f"train.global_batch={2 * dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                 f"checkpoint.interval={STEPS}"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--master-addr=127.0.0.1",
            f"--master-port={port}", "-m", "megafixed.cli", "train", "/dev/null", *overrides]


def time_world(world: int, kind: str, workdir: Path, index: int) -> dict:
    """One run at ``world`` ranks: phase walls, CPU, peak RSS per rank and the log's shape."""
    from .startup_common import _env, _free_port

    env = {**_env(), "PYTHONUNBUFFERED": "1"}
    cmd = command(world, kind, workdir / f"w{world}_{index}", _free_port())
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    at: dict = {}
    lines: list[str] = []
    for line in proc.stdout:
        now = time.perf_counter() - t0
        line = line.rstrip("\n")
        lines.append(line)
        for name, pattern in MARKS:
            if name not in at and pattern.search(line):
                at[name] = now
    code = proc.wait()
    end = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0 or len(at) != len(MARKS):
        raise RuntimeError(f"bench startup --world: {world} ranks failed (exit {code}; saw {sorted(at)}):\n"
                           + "\n".join(lines[-40:]))
    phases, last = {}, 0.0
    for name, _ in MARKS:
        phases[name] = round(at[name] - last, 3)
        last = at[name]
    phases["exit"] = round(end - last, 3)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(end, 3), "cpu_s": round(cpu, 3), "phases_s": phases,
            "max_rss_mb": round(after.ru_maxrss / 1024, 1),  # the largest single process (a rank), Linux KiB
            "log_lines": len(lines), "warning_lines": sum(bool(WARNING_LINE.search(ln)) for ln in lines),
            "per_rank_lines": sum(bool(PER_RANK_LINE.search(ln)) for ln in lines),
            "warnings": [ln[:300] for ln in lines if WARNING_LINE.search(ln)]}


def measure(worlds: list[int], kind: str, rounds: int, workdir: Path) -> dict:
    samples: dict = {w: [] for w in worlds}
    load_before = os.getloadavg()
    for r in range(rounds):
        for w in worlds:
            samples[w].append(time_world(w, kind, workdir, r))
    cores = os.cpu_count() or 1
    out = {}
    for w, runs in samples.items():
        def med(key, runs=runs):
            return statistics.median(run[key] for run in runs)

        phases = {p: round(statistics.median(run["phases_s"][p] for run in runs), 3) for p in runs[0]["phases_s"]}
        tp, pp, dp = layout(w, kind)
        out[w] = {"tp": tp, "pp": pp, "dp": dp, "wall_s": round(med("wall_s"), 3), "cpu_s": round(med("cpu_s"), 3),
                  "cpu_s_per_rank": round(med("cpu_s") / w, 3), "phases_s": phases,
                  # the phase's wall per rank of the machine's share: flat when it costs the same per rank
                  "phases_s_per_rank_share": {p: round(v * min(cores, w) / w, 3) for p, v in phases.items()},
                  "max_rss_mb": max(run["max_rss_mb"] for run in runs),
                  "log_lines": max(run["log_lines"] for run in runs),
                  "warning_lines": max(run["warning_lines"] for run in runs),
                  "per_rank_lines": max(run["per_rank_lines"] for run in runs),
                  "warnings": runs[-1]["warnings"], "samples": runs}
    base = out[min(worlds)]
    for w, row in out.items():
        row["ratio_to_smallest"] = {
            "world": round(w / min(worlds), 3), "wall": round(row["wall_s"] / base["wall_s"], 3),
            "cpu_per_rank": round(row["cpu_s_per_rank"] / base["cpu_s_per_rank"], 3),
            "phases_per_rank_share": {p: round(v / base["phases_s_per_rank_share"][p], 3) if
                                      base["phases_s_per_rank_share"][p] else None
                                      for p, v in row["phases_s_per_rank_share"].items()}}
    return {"layout": kind, "steps": STEPS, "rounds": rounds, "baseline_world": min(worlds), "cores": cores,
            "worlds": out, "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}


def report_lines(result: dict) -> list[str]:
    phases = [name for name, _ in MARKS] + ["exit"]
    lines = [f"start-up by world size, {result['layout']} layout, {result['steps']} steps, median of "
             f"{result['rounds']} (load {result['loadavg_before'][0]:.1f} -> {result['loadavg_after'][0]:.1f}, "
             f"{result['cores']} cores); seconds of wall per phase, then per rank of the machine's share:",
             f"  {'world':>5} {'layout':>9} " + " ".join(f"{p:>10}" for p in phases) +
             f" {'wall':>7} {'cpu/rank':>8} {'rss MB':>7} {'lines':>5} {'warn':>4}"]
    for w, row in result["worlds"].items():
        layout_words = f"{row['tp']}x{row['pp']}x{row['dp']}"
        lines.append(f"  {w:>5} {layout_words:>9} " + " ".join(f"{row['phases_s'][p]:>10.2f}" for p in phases) +
                     f" {row['wall_s']:>7.1f} {row['cpu_s_per_rank']:>8.2f} {row['max_rss_mb']:>7.0f} "
                     f"{row['log_lines']:>5} {row['warning_lines']:>4}")
        lines.append(f"  {'':>5} {'per rank':>9} " +
                     " ".join(f"{row['phases_s_per_rank_share'][p]:>10.2f}" for p in phases))
    return lines


def parse_worlds(text: str) -> list[int]:
    from ..config import ConfigError

    try:
        worlds = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--world {text!r}: a comma-separated list of world sizes, e.g. 2,8,16,32") from None
    if not worlds or worlds[0] < 2:
        raise ConfigError(f"--world {text!r}: every world size must be >= 2 (a launch of several ranks)")
    return worlds


def run_worlds(args) -> int:
    from ..config import ConfigError
    from ..outputs import claim_output

    worlds = parse_worlds(args.world)
    if args.rounds < 1:
        raise ConfigError(f"--rounds {args.rounds} must be >= 1")
    if args.json is not None:
        claim_output([args.json], overwrite=args.overwrite, what="benchmark output")
    with tempfile.TemporaryDirectory(prefix="megafixed-bench-startup-world-") as tmp:
        result = measure(worlds, args.layout, args.rounds, Path(tmp))
    print("\n".join(report_lines(result)))
    if args.json is not None:
        from ..atomic import atomic_write_text

        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    return 0
