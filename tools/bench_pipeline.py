"""Step time of each pipeline schedule of the torch engine at PP2, beside the bubble ``plan`` predicts.

    python -m torch.distributed.run --nproc-per-node 2 tools/bench_pipeline.py OUT.json [--rounds 3]

In one 2-rank world it builds the engine of every schedule (``build_engine`` on
``setup_distributed(RunPlan.build(cfg, 2))``, what ``megafixed train`` builds) for the same model and
batches, and times ``train_step`` in alternating rounds (every schedule sees the same machine load);
the JSON has, per schedule, the median step time, its ratio to 1F1B's measured in the same run, and
the bubble fraction the planner reads from the schedule's action table (and the closed form). CPU
timings are CPU timings: gloo sends through loopback TCP and two processes share the cores, so the
ratios show the schedules' overheads more than their bubbles; a GPU run is the one that tests the
bubble figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

SCHEDULES = (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2), ("InterleavedZeroBubble", 2),
             ("ZBVZeroBubble", 2), ("DualPipeV", 2))
MODEL = ["model.vocab_size=512", "model.d_model=256", "model.n_layers=6", "model.n_heads=4", "model.code_bits=9",
         "model.max_seq_len=128", "data.seq_len=128", "train.global_batch=16", "train.micro_batch=2",
         "train.engine=torch", "parallel.pp=2", "model.input=canonical"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    from megafixed.config import load_config
    from megafixed.engine import build_engine
    from megafixed.engine.native.bubble import bubble
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan

    engines = {}
    for name, vpp in SCHEDULES:
        cfg = load_config(None, [*MODEL, f"parallel.pp_schedule={name}", f"parallel.vpp={vpp}"])
        topo = setup_distributed(RunPlan.build(cfg, 2))  # this machine: gloo and fp32 on CPU, NCCL and bf16 on GPUs
        engines[name] = (build_engine(cfg, topo), cfg)
    data = torch.randint(0, 512, (16, 129), generator=torch.Generator().manual_seed(0))
    times: dict = {name: [] for name in engines}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, (engine, cfg) in engines.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            for s in range(args.steps):
                engine.train_step(iter(data.split(cfg.train.micro_batch)), 1e-4, s)
            torch.distributed.barrier()
            if r:
                times[name].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times["1F1B"])
    rows = {}
    for name, (engine, cfg) in engines.items():
        b = bubble(name, 2, engine.plan.batch.accum, cfg.parallel.vpp)
        step = statistics.median(times[name])
        rows[name] = {"vpp": cfg.parallel.vpp, "microbatches": engine.plan.batch.accum, "step_s": step,
                      "vs_1f1b": step / base, "bubble_plan": b.fraction, "bubble_formula": b.formula,
                      "in_flight_per_rank": b.in_flight, "samples_s": times[name]}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as fh:
            json.dump({"device": "cpu", "world_size": 2, "model": MODEL, "rows": rows}, fh, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
