"""Training time lost per checkpoint save, sync against ``checkpoint.async_save=true``.

    python -m megafixed.train.bench_save CONFIG [overrides...] --steps 24 --every 4

Runs ``train()`` three times in one process on mock data (``data.mock=true``): saving only at the
end, saving every ``--every`` steps synchronously, and the same asynchronously. Time lost per save =
(wall time with saves - wall time without) / number of extra saves; the final save (and, async,
the wait for it) is in every run, so it cancels out. Results: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time


def main(argv=None) -> None:
    from ..engine import prepare_runtime_env

    prepare_runtime_env()
    from ..config import load_config
    from ..parallel import setup_distributed
    from ..run_plan import RunPlan
    from .trainer import train

    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4)
    a = ap.parse_args(argv)
    out, topo = {}, None
    # An untimed warm-up run first: the first engine in a process pays one-off costs (DeepSpeed's op
    # load, allocator growth, thread pools) that would otherwise be charged to whichever mode runs first.
    for mode, extra in (("warmup", [f"checkpoint.interval={10 ** 9}"]),
                        ("none", [f"checkpoint.interval={10 ** 9}"]),
                        ("sync", [f"checkpoint.interval={a.every}", "checkpoint.async_save=false"]),
                        ("async", [f"checkpoint.interval={a.every}", "checkpoint.async_save=true"])):
        with tempfile.TemporaryDirectory() as d:
            cfg = load_config(a.config, [*a.overrides, "data.mock=true", f"train.max_steps={a.steps}",
                                         "validation.interval=0", "metrics.tensorboard=false",
                                         f"metrics.interval={a.steps}", f"train.run_dir={d}/run",
                                         "checkpoint.keep=2", *extra])
            topo = topo or setup_distributed(RunPlan.for_launch(cfg))
            t0 = time.perf_counter()
            train(cfg, topo, log=lambda *_: None)
            out[mode] = time.perf_counter() - t0
    out.pop("warmup")
    saves = a.steps // a.every - 1
    res = {"wall_s": out, "saves": saves,
           "lost_per_save_s": {m: (out[m] - out["none"]) / saves for m in ("sync", "async")}}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
