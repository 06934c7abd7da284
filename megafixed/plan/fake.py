"""``megafixed plan --fake``: one real step per row under fake tensors, through the engine's own build.

Each row is measured in a process of its own (``python -m <its engine's facts.fake_worker>``): a fake process
group has one world size per process, and a process per row keeps memory bounded and a failure to
its row. An engine without a ``fake_worker`` (DeepSpeed) gets its refusal in the row.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

# The fake process group holds nothing per peer, but the mesh is built in full on one process and
# a world this large is no plan anyone queues; refusing keeps --fake's cost bounded.
MAX_FAKE_WORLD = 16384
ROW_TIMEOUT_S = 1800


def _worker(layout) -> str | None:
    from ..engines import engine_kind

    return engine_kind(layout.engine).facts.fake_worker


def refusal(layout, planner, gpus: int) -> str | None:
    if _worker(layout) is None:
        return planner.fake_refusal(layout)
    if gpus > MAX_FAKE_WORLD:
        return f"--fake measures up to {MAX_FAKE_WORLD} ranks, not {gpus}"
    if layout.cp > 1 and layout.cp_method == "ring":
        return ("ring attention is not measured under fake tensors (torch's context_parallel dispatches to CUDA "
                "attention kernels only); --fake measures parallel.cp_method=ulysses rows")
    return planner.fake_refusal(layout)


def measure_row(args, planner, layout) -> dict:
    """One row's fake measurement in its own process, or ``{"refused": why}``."""
    why = refusal(layout, planner, args.gpus)
    if why:
        return {"refused": why}
    spec = {"config": args.config, "overrides": list(args.overrides), "gpus": args.gpus,
            "precision": args.precision, "layout": asdict(layout)}
    try:
        done = subprocess.run([sys.executable, "-m", _worker(layout)], input=json.dumps(spec),
                              capture_output=True, text=True, timeout=ROW_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"refused": f"the fake step took over {ROW_TIMEOUT_S} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"refused": f"the fake worker exited {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def measure_rows(args, planner, estimates, sharding, progress=None) -> list:
    """``measure_row`` for each estimate, one progress line each (on stderr, so --json stays one object);
    ``sharding(layout)``: the table's sharding column, as the line names the row."""
    from ..parallel.memory import GiB

    out = []
    for i, e in enumerate(estimates, 1):
        got = measure_row(args, planner, e.layout)
        lay = e.layout
        cp = f" cp {lay.cp}" if lay.cp > 1 else ""
        where = f"tp {lay.tp}{cp} pp {lay.pp} dp {lay.dp} ({sharding(lay)}) mb {lay.micro_batch}"
        if "refused" in got:
            line = f"fake {i}/{len(estimates)}: {where}: {got['refused']}"
        else:
            line = (f"fake {i}/{len(estimates)}: {where}: peak {got['peak_bytes'] / GiB:.2f} GiB "
                    f"(analytic {e.tensors / GiB:.2f} + reserve {e.reserve / GiB:.0f}) in {got['seconds']:.0f} s")
        print(line, file=progress or sys.stderr, flush=True)
        out.append(got)
    return out
