"""The fake measurement's reference: the same step really run on 4 gloo processes, same trackers.

Launched by torchrun (tests/test_fake_measure.py) with a JSON file of ``fake_worker`` specs (one
per case, each for the world's size). Every rank builds the case's run plan and really trains it with
``fake_measure.measure_step`` -- the function the fake run calls, the engine's own build and
``train_step``, now on real tensors and a real process group -- and rank 0 writes every rank's peak
by part, collectives' bytes (by kind and mesh axis) and step results, per case, as JSON.

    torchrun --nproc-per-node 4 tests/fake_measure_worker.py SPECS.json OUT.json
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from megafixed.engine.native.fake_measure import measure_step, topology
from megafixed.engine.native.fake_worker import layout_config
from megafixed.run_plan import RunPlan


def main(specs_path: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = []
    for spec in json.loads(open(specs_path).read()):
        cfg = layout_config(spec)
        plan = RunPlan.build(cfg, dist.get_world_size(), gpu=True)  # the plan the fake run measures
        got = measure_step(cfg, topology(cfg, plan, rank, torch.device("cpu")))
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, got)  # each rank's: a pipeline's stages differ
        out.append(every)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
