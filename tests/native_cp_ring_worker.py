"""``native_cp_worker.py`` with ring attention emulated on CPU (tests/test_native_cp_ring.py): torch's ring
kernels take only CUDA SDPA, so here SDPA is ``cp_ring_worker``'s emulation (gather + the load balancer's
causal mask) and the CPU refusal of ``parallel.cp_method=ring`` is stepped round (the plan is built as
Ulysses' and then marked ring); everything else -- ``ring.batch_context`` in the torch engine's step,
validation and pipeline, FSDP2 over dp_shard_cp, the loss over dp x cp -- is what runs on CUDA.

    torchrun --nproc-per-node 2 tests/native_cp_ring_worker.py SPEC.json OUT.json
"""
from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import cp_ring_worker  # noqa: E402
import native_cp_worker  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megafixed.run_plan import RunPlan  # noqa: E402

PLAIN_BUILD = RunPlan.build.__func__
RING_CALLS: list = []


def build(cls, cfg, world, *, gpu=None):
    """The plan of a ring run as on CUDA: built as Ulysses' (which CPU allows), then marked ring."""
    if cfg.parallel.cp_method != "ring":
        return PLAIN_BUILD(cls, cfg, world, gpu=gpu)
    cfg.parallel.cp_method = "ulysses"
    try:
        plan = PLAIN_BUILD(cls, cfg, world, gpu=gpu)
    finally:
        cfg.parallel.cp_method = "ring"
    return dataclasses.replace(plan, cp_method="ring", config=cfg)


def scaled_dot_product_attention(q, *args, **kwargs):
    from torch.distributed.tensor import DTensor

    if isinstance(q, DTensor) and not RING_CALLS:
        RING_CALLS.append(tuple(q.to_local().shape))
        print(f"ring attention: local q {tuple(q.to_local().shape)} of {tuple(q.shape)}", file=sys.stderr, flush=True)
    return cp_ring_worker.scaled_dot_product_attention(q, *args, **kwargs)


if __name__ == "__main__":
    RunPlan.build = classmethod(build)
    F.scaled_dot_product_attention = scaled_dot_product_attention
    native_cp_worker.main()
