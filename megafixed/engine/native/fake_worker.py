"""``python -m megafixed.engine.native.fake_worker``: one fake measurement in a process of its own.

Reads one JSON object on stdin (``config``, ``overrides``, ``gpus``, ``precision``, ``layout``: the
``parallel.memory.Layout`` fields) and prints one JSON object on stdout: ``fake_measure``'s result,
or ``{"refused": why}``. A process per layout because a fake process group has one world size per
process and is torn down with it, so rows cannot leak memory or state into each other and one
row's failure is that row's alone (``megafixed plan --fake`` runs them).
"""
from __future__ import annotations

import json
import sys


def layout_config(spec: dict):
    """The run config of ``spec``'s layout: the config with the layout's keys set (as ``plan`` sizes it)."""
    from ...config import load_config
    from ...engines import engine_kind

    cfg = load_config(spec["config"], spec.get("overrides", []))
    lay = spec["layout"]
    cfg.parallel.tp, cfg.parallel.pp = lay["tp"], lay["pp"]
    engine_kind(cfg.train.engine).hook("planner").set_sharding(cfg, lay["dp_replicate"])
    cfg.parallel.sequence_parallel, cfg.train.micro_batch = lay["sequence_parallel"], lay["micro_batch"]
    cfg.train.activation_checkpointing = lay["activation_checkpointing"]
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
    return measure_fake(cfg, plan)


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
