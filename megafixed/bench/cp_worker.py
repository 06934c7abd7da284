"""One rank of a world of ``megafixed bench cp``: ``python -m megafixed.bench.cp_worker SPEC OUT`` under
torchrun's environment variables (RANK, WORLD_SIZE = cp, MASTER_ADDR, MASTER_PORT; ``bench/cp.py`` sets them).

Every rank builds the torch engine at ``parallel.cp`` = the world size (dp 1) for each sequence length
of the spec, measures one rank's peak by part with the planner's tracker (``fake_measure.measure_step``
on real tensors), then times a fresh build's steps; rank 0 writes one row per sequence length as JSON.
"""
from __future__ import annotations

import json
import statistics
import sys
import time


def _row(spec: dict, seq: int, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from ..config import load_config
    from ..engine.native.build import build
    from ..engine.native.fake_measure import measure_step, topology
    from ..engine.native.planner import make_layout
    from ..parallel.memory import estimate
    from ..run_plan import RunPlan

    longest = max(spec["seq_lens"])
    cfg = load_config(spec["config"], [*spec["overrides"], "train.engine=torch", "data.mock=true",
                                       f"data.seq_len={seq}", f"model.max_seq_len={longest}", f"parallel.cp={world}",
                                       "parallel.cp_method=ulysses", "parallel.tp=1", "parallel.pp=1"])
    plan = RunPlan.build(cfg, world, gpu=False)
    topo = topology(cfg, plan, rank, torch.device("cpu"))
    mem = measure_step(cfg, topo)
    parts = mem["parts"]
    b = plan.batch
    from dataclasses import replace

    layout = replace(make_layout(cfg, 1, 1, plan.dp, 1, b.micro_batch, False, "parameters"), cp=world)
    analytic = estimate(cfg.model, seq, layout, plan.precision).activations
    engine = build(cfg, topo)
    gen = torch.Generator().manual_seed(cfg.train.seed)
    batches = [torch.randint(0, cfg.model.vocab_size, (b.micro_batch, seq + 1), generator=gen) for _ in range(b.accum)]
    times = []
    for i in range(spec["warmup_steps"] + spec["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_step(iter(batches), cfg.optimizer.lr, i)
        if i >= spec["warmup_steps"]:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    tokens = b.global_batch * seq
    return {"cp": world, "seq_len": seq, "micro_batch": b.micro_batch, "accum": b.accum, "precision": plan.precision,
            "peak_bytes": mem["peak_bytes"], "activation_bytes": sum(v for k, v in parts.items() if k.endswith("ACT")),
            "temp_bytes": sum(v for k, v in parts.items() if k.endswith("TEMP")), "parts": parts,
            "analytic_activation_bytes": analytic,
            # by kind: at dp 1 the cp group is the FSDP2 group too, and only Ulysses runs all-to-alls
            "cp_all_to_all_bytes": mem["comm"].get("all_to_all", {}).get("bytes", 0),
            "step_times_s": times, "step_s_median": step, "tokens_per_step": tokens, "tokens_per_s": tokens / step}


def main(spec_path: str, out_path: str) -> int:
    import torch.distributed as dist

    spec = json.loads(open(spec_path).read())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [_row(spec, seq, rank, world) for seq in spec["seq_lens"]]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
