"""The DeepSpeed engine's measured step memory, for its analytic model's check.

Launched by torchrun on 2 gloo ranks (tests/test_deepspeed_memory.py) with a precision, the
comma-separated ZeRO stages and config overrides. Every stage builds a fresh engine in the same
processes (one launch: each costs every rank its torch/DeepSpeed imports) and is measured by
``engine.deepspeed.measure_memory.measure_step``; rank 0 writes ``{stage: [rank 0's, rank 1's]}``.

    torchrun --nproc-per-node 2 tests/deepspeed_memory_worker.py OUT.json bf16 1,2,3 key=value ...
"""
from __future__ import annotations

import gc
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch.distributed as dist  # noqa: E402


def main(out_path: str, precision: str, stages: str, overrides: list[str]) -> None:
    from megafixed.config import load_config
    from megafixed.engine.deepspeed.measure_memory import measure_step
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan

    topo, results = None, {}
    for stage in stages.split(","):
        cfg = load_config(None, [*overrides, f"zero.stage={stage}"])
        # the CPU plan (fp32); the engine is built in `precision` (bf16 runs on DeepSpeed's CPU accelerator)
        topo = topo or setup_distributed(RunPlan.for_launch(cfg))
        mine = measure_step(cfg, topo, precision)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results[stage] = gathered
        gc.collect()  # the stage's engine, before the next one is built
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump(results, fh)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
    # Leave without DeepSpeed's atexit teardown (parallel_worker.py: it has been seen to SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
