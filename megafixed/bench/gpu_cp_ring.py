"""The GPU check's ring-attention worker (``gpu_stages.cp_ring`` launches it; never part of the test suite):
CP2 ring attention (``engine/native/ring.py``) against CP1, in ONE torchrun launch of two processes.

Each rank builds the same small GPT (same seed) and batch, computes the one-process reference itself (whole
sequences: the loss and every gradient), then the same step on a second copy of the model under
``ring_context`` over the 1-D mesh of both ranks; the loss and the gradients are then averaged over the
two ranks (each rank's loss is the mean over its half of every sequence: equal halves) and compared with
the reference: loss and gradient norm within 1e-5 (relative) in fp32, 1e-3 in bf16 (autocast, as the
engine's one-rank compute; the ring merges its partial outputs in fp32).

Two GPUs: NCCL, one GPU each. One GPU: both processes on cuda:0 over gloo (NCCL refuses two ranks on one
device; gloo stages CUDA tensors through the host), after a probe of the collectives the ring uses (an
all-gather of the keys and values, an all-to-all of their gradients); where gloo cannot, the result says
``skipped`` and why: the stage then needs two GPUs.

``--method ulysses --device cpu``: the same comparison with Ulysses (``parallel/context.py``) on CPU over
gloo, the harness's dry run (tests/test_cp_ring.py); it checks the harness, not the ring.

    torchrun --nproc-per-node 2 -m megafixed.bench.gpu_cp_ring OUT_DIR [--method ring|ulysses] [--device cuda|cpu]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# (name, model fields, compute dtype, sequence length, activation checkpointing, tolerance): GQA (4 query
# heads, 2 key/value heads) everywhere; 250 positions do not split into 2 * cp chunks, so torch shards them
# contiguously without load balancing (the other branch of its ring); the fixed code with the fused first
# layer runs its Triton kernels on the shards, and activation checkpointing recomputes ring attention.
CASES = (
    ("fp32", {}, "fp32", 256, False, 1e-5),
    ("fp32_unbalanced", {}, "fp32", 250, False, 1e-5),
    ("bf16", {}, "bf16", 256, False, 1e-3),
    ("bf16_gf2_fused_ac", {"input": "gf2", "fused_first_layer": True, "code_bits": 10}, "bf16", 256, True, 1e-3),
)
BATCH = 2


def model_config(fields: dict):
    from ..model.config import ModelConfig

    return ModelConfig(**{"vocab_size": 1024, "d_model": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                          "max_seq_len": 512, "input": "learned", **fields})


def _step(model, inputs, labels, dtype: str, device: torch.device) -> torch.Tensor:
    """One forward and backward (bf16: autocast over fp32 weights); the loss, detached."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
        loss = model(inputs, labels)
    loss.backward()
    return loss.detach().float()


def _norm(grads) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads))


def run_case(case, method: str, device: torch.device, mesh) -> dict:
    from ..model.gpt import GPT

    name, fields, dtype, seq, checkpointing, tol = case
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model_config(fields)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, seq + 1), generator=gen).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    ref, cp = GPT(cfg, seed=3).to(device), GPT(cfg, seed=3).to(device)
    ref.activation_checkpointing = cp.activation_checkpointing = checkpointing
    ref_loss = float(_step(ref, inputs, labels, dtype, device))
    ref_grads = [p.grad for p in ref.parameters()]
    if method == "ring":
        from ..engine.native.ring import ring_context

        with ring_context(mesh, cp, inputs, labels) as shard:
            loss = _step(cp, shard.inputs, shard.labels, dtype, device)
    else:
        from ..parallel.context import UlyssesAttention, shard_model, shard_tokens

        shard_model(cp, rank, world, seq, lambda core: UlyssesAttention(core, dist.group.WORLD, world))
        loss = _step(cp, shard_tokens(inputs, rank, world), shard_tokens(labels, rank, world), dtype, device)
    dist.all_reduce(loss)
    loss = float(loss) / world
    grads = [p.grad for p in cp.parameters()]
    for g in grads:  # what FSDP2's reduce-scatter over dp_shard_cp does: the mean over the cp ranks
        dist.all_reduce(g)
        g /= world
    norm, ref_norm = _norm(grads), _norm(ref_grads)
    grad_err = max(float((g - r).abs().max()) / max(float(r.abs().max()), 1e-30) for g, r in zip(grads, ref_grads))
    loss_rel, norm_rel = abs(loss - ref_loss) / abs(ref_loss), abs(norm - ref_norm) / ref_norm
    ok = loss_rel <= tol and norm_rel <= tol and math.isfinite(loss)
    return {"case": name, "dtype": dtype, "seq_len": seq, "activation_checkpointing": checkpointing, "loss": loss,
            "loss_cp1": ref_loss, "loss_rel": loss_rel, "grad_norm": norm, "grad_norm_cp1": ref_norm,
            "grad_norm_rel": norm_rel, "max_grad_rel_err": grad_err, "tolerance": tol, "ok": ok}


def _probe(device: torch.device) -> str:
    """'' when this process group carries the ring's collectives on ``device`` tensors, else why not."""
    try:
        x = torch.full((4,), float(dist.get_rank() + 1), device=device)
        gathered = torch.empty(4 * dist.get_world_size(), device=device)
        dist.all_gather_into_tensor(gathered, x)
        swapped = torch.empty_like(x)
        dist.all_to_all_single(swapped, x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return ""
    except Exception as e:  # noqa: BLE001 -- any refusal of the backend is the answer
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def compare(method: str, device: torch.device, mesh, names: str = "") -> tuple[list, list]:
    """Every case (``names``: a comma-separated choice) at CP = the world against CP1, in this process group:
    (one result per case, the failures named)."""
    results, failures = [], []
    for case in (c for c in CASES if not names or c[0] in names.split(",")):
        try:
            out = run_case(case, method, device, mesh)
        except Exception as e:  # noqa: BLE001 -- recorded, and the stage fails naming it
            out = {"case": case[0], "ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
            # in the launch's output too: a peer left waiting in a collective may stop the run before rank 0 writes
            traceback.print_exc()
            print(f"rank {dist.get_rank()}: case {case[0]} failed: {out['error']}", file=sys.stderr, flush=True)
        results.append(out)
        if not out["ok"]:
            failures.append(f"{case[0]}: " + (out.get("error") or (
                f"loss {out['loss']:.6g} vs {out['loss_cp1']:.6g} (rel {out['loss_rel']:.1e}), grad norm "
                f"{out['grad_norm']:.6g} vs {out['grad_norm_cp1']:.6g} (rel {out['grad_norm_rel']:.1e}) > "
                f"{out['tolerance']:.0e}")))
    return results, failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--method", choices=("ring", "ulysses"), default="ring")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = ap.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", local % gpus)
        torch.cuda.set_device(device)
        backend = "nccl" if gpus >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")) else "gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(device.type, list(range(dist.get_world_size())), mesh_dim_names=("cp",))
    res = {"bench": "cp_ring", "method": args.method, "backend": backend, "world": dist.get_world_size(),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "cases": [],
           "torch": torch.__version__}
    why = _probe(device) if backend == "gloo" and device.type == "cuda" else ""
    failures = []
    if why:
        res["skipped"] = (f"two processes on one GPU: gloo cannot carry the ring's collectives on CUDA tensors "
                          f"here ({why}); the stage needs two GPUs (NCCL)")
    else:
        res["cases"], failures = compare(args.method, device, mesh, args.cases)
    res["failures"] = failures
    res["summary"] = {"ok": not failures, "backend": backend, "failures": failures, **(
        {"skipped": res["skipped"]} if why else {}), "cases": {c["case"]: {k: c.get(k) for k in (
            "loss_rel", "grad_norm_rel", "max_grad_rel_err", "ok")} for c in res["cases"]}}
    if dist.get_rank() == 0:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.out_dir) / "cp_ring.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
