"""``python -m megafixed.engine.native.fake_worker``: one fake measurement in a process of its own.

Reads one JSON object on stdin (``config``, ``overrides``, ``gpus``, ``precision``, ``layout``: the
``parallel.memory.Layout`` fields; ``rank``: the one rank to measure, default rank 0 and, under
PP, the last stage's rank too) and prints one JSON object on stdout: ``fake_measure``'s result,
or ``{"refused": why}``. A process per layout because a fake process group has one world size per
process and is torn down with it, so rows cannot leak memory or state into each other and one
row's failure is that row's alone (``megafixed plan --fake`` runs them).
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict


def layout_config(spec: dict):
    """The run config of ``spec``'s layout: the config with the layout's keys set (as ``plan`` sizes it)."""
    from ...config import apply_overrides, load_config
    from ...engines import engine_kind
    from ...parallel.memory import Layout

    cfg = load_config(spec["config"], spec.get("overrides", []))
    lay = asdict(Layout(**spec["layout"]))  # a partial layout: the rest at Layout's defaults
    cfg.parallel.tp, cfg.parallel.pp = lay["tp"], lay["pp"]
    cfg.parallel.cp, cfg.parallel.cp_method = lay["cp"], lay["cp_method"]
    apply_overrides(cfg, engine_kind(cfg.train.engine).planner.sharding_overrides(Layout(**spec["layout"])))
    cfg.parallel.sequence_parallel, cfg.train.micro_batch = lay["sequence_parallel"], lay["micro_batch"]
    cfg.train.activation_checkpointing = lay["activation_checkpointing"]
    cfg.parallel.pp_schedule, cfg.parallel.vpp = lay["schedule"], lay["vpp"]
    cfg.parallel.pp_input_head_layers = lay["edge"]
    cfg.torch_engine.reshard_after_forward = lay["reshard_after_forward"]
    cfg.train.precision = spec["precision"]
    cfg.parallel.backend = "auto"
    return cfg


def measure(spec: dict) -> dict:
    from ...run_plan import RunPlan
    from .fake_measure import check_measurable, measure_fake

    cfg = layout_config(spec)
    plan = RunPlan.build(cfg, spec["gpus"], gpu=True)
    why = check_measurable(plan)
    if why:
        return {"refused": why}
    if plan.pp == 1 or "rank" in spec:
        return measure_fake(cfg, plan, spec.get("rank", 0))
    # Under PP the ranks differ: the first stage holds the most microbatches in flight, the last the
    # head and the loss. Both are measured (rank 0's grid position on the other axes); the row is the
    # larger, as the analytic row is its most loaded rank. The last stage in a process of its own,
    # meanwhile: a second fake world in one process trips over the first one's cached TP groups.
    last = subprocess.Popen([sys.executable, "-m", "megafixed.engine.native.fake_worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    last.stdin.write(json.dumps({**spec, "rank": plan.dims.rank_of(pp=plan.pp - 1)}))
    last.stdin.close()
    first = measure_fake(cfg, plan, 0)
    out, err = last.stdout.read(), last.stderr.read()
    last.wait()
    lines = out.strip().splitlines()
    if last.returncode or not lines:
        raise RuntimeError(f"the last stage's measurement exited {last.returncode}: "
                           f"{(err.strip().splitlines() or ['no output'])[-1]}")
    stages = {"0": first, str(plan.pp - 1): json.loads(lines[-1])}
    if "refused" in stages[str(plan.pp - 1)]:
        return stages[str(plan.pp - 1)]
    worst = max(stages.values(), key=lambda m: m["peak_bytes"])
    # the row's traffic is its busiest stage's, as the analytic row's (parallel.traffic: the stage with the most
    # parameters), which need not be the stage with the highest peak (the first, without checkpointing)
    busiest = max(stages.values(), key=lambda m: sum(c["bytes"] for c in m["comm"].values()))
    return {**worst, "comm": busiest["comm"], "comm_by_axis": busiest["comm_by_axis"],
            "seconds": max(m["seconds"] for m in stages.values()), "pp_stages": stages}


def main() -> int:
    spec = json.loads(sys.stdin.read())
    try:
        out = measure(spec)
    except Exception as e:  # reported as the row's failure: plan --fake shows it beside the row
        out = {"refused": f"the fake step failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
