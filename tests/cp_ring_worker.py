"""torchrun worker of tests/test_cp_ring.py (gloo, CPU): the GPU stage's comparison (``megafixed.bench.gpu_cp_ring``)
with Ulysses, and with ``ring_context`` over an emulated ring, in one world.

torch's ring kernels run only on CUDA; what ``ring_context`` owns (the shards of inputs, labels and RoPE rows in
torch's load-balanced order, torch's SDPA wrapper, the per-rank loss mean) is exercised here with SDPA itself
replaced, before the context wraps it, by attention that the ring computes by other means: each rank's queries
against the keys and values of every rank (gathered, gradients reduced back), under the causal mask of the
positions torch's load balancer gave each rank. Equal to one process => the sharding, the RoPE rows and the loss
are consistent with what torch's ring assumes; the ring kernels themselves are torch's (and the GPU stage's).

    torchrun --nproc-per-node 2 tests/cp_ring_worker.py OUT.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

from megafixed.bench.gpu_cp_ring import compare

PLAIN = F.scaled_dot_product_attention


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, H, t, hd]`` of every rank, concatenated on the sequence in rank order (backward: the sum's slice)."""
    return wait_tensor(all_gather_single_autograd(x.movedim(2, 0).contiguous(), 0, group)).movedim(0, 2)


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
    """Plain SDPA for plain tensors; for torch's ring inputs (DTensors sharded on the sequence), the same
    attention through a gather of the keys and values and an explicit mask of the balancer's positions."""
    if not isinstance(q, DTensor):
        return PLAIN(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)
    assert attn_mask is None and is_causal and dropout_p == 0.0
    mesh = q.device_mesh
    group, cp, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    t = q.to_local().shape[2]
    seq = t * cp
    order = (_HeadTailLoadBalancer(seq, cp, "cpu")._generate_indices()[0] if seq % (2 * cp) == 0
             else torch.arange(seq))  # torch shards contiguously where the sequence has no 2 * cp chunks
    mask = order.view(cp, t)[rank][:, None] >= order[None, :]
    out = PLAIN(q.to_local(), _gather_seq(k.to_local(), group), _gather_seq(v.to_local(), group),
                attn_mask=mask.to(q.device), scale=scale, **kw)
    return DTensor.from_local(out, mesh, q.placements, run_check=False)


def main(out: str) -> int:
    dist.init_process_group("gloo")
    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())), mesh_dim_names=("cp",))
    res = {}
    res["ulysses"] = compare("ulysses", torch.device("cpu"), mesh, "fp32")
    F.scaled_dot_product_attention = scaled_dot_product_attention  # what torch's context wraps
    try:
        res["ring"] = compare("ring", torch.device("cpu"), mesh, "fp32,fp32_unbalanced,bf16_gf2_fused_ac")
    finally:
        F.scaled_dot_product_attention = PLAIN
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(res, indent=2, default=str))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
