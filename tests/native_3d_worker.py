"""Several ``megafixed train`` runs of the torch engine in ONE 8-rank gloo world (tests/test_native_3d.py).

Each run is what ``megafixed train`` does after its imports -- ``train(cfg, setup_distributed(
RunPlan.for_launch(cfg)))`` -- one after another in the same world, so eight ranks pay their imports
once for all of them. Runs may start from a copy of an earlier run's directory rewound to one of
its checkpoints (a resume at another layout), and may carry a drill (``faults.inject``) (the last run:
``exit@N`` SIGKILLs every rank mid-run, which ends this launch; the test reruns the same command).

On every rank the bad-step guard's inputs (the reduced loss and the global gradient norm, as the
guard is asked) are recorded bit for bit, and every warning torch's loggers emit is counted; after
each run rank 0 gathers them and writes, per run, whether all ranks saw the same bits, what was
recorded, the lines rank 0 logged and the number of DTensor "sequential all_reduce" warnings:

    torchrun --nproc-per-node 8 tests/native_3d_worker.py SPEC.json OUT.json

SPEC.json: ``{"runs": [{"name": .., "overrides": [..], "rewind": [SRC_RUN_DIR, TAG] | null,
"inject": "exit@4" | null}, ...]}``.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch.distributed as dist  # noqa: E402

JUDGED: list = []  # (step, what, value's bits) as this rank's guard was asked
TORCH_WARNINGS: list = []  # (logger, first line) of every WARNING record of torch's loggers on this rank
FSDP_MESHES: list = []  # (dimension names, sizes) of each mesh the engine gave FSDP2 on this rank


def bits(x) -> str:
    return "none" if x is None else struct.pack("<d", float(x)).hex()


def spy_on_the_guard() -> None:
    from megafixed.train.callbacks.guard.verdict import BadStepGuard

    real = BadStepGuard.judge

    def judge(self, step, what, value):
        JUDGED.append((step, what, bits(value)))
        return real(self, step, what, value)

    BadStepGuard.judge = judge


def spy_on_the_fsdp_mesh() -> None:
    """What FSDP2 really shards over (a 2-D replicate x shard mesh is HSDP): the plan's description alone would
    read the same if ``torch_engine.dp_replicate`` were ignored."""
    from megafixed.engine.native import mesh as meshes

    real = meshes.dp_mesh

    def dp_mesh(mesh):
        out = real(mesh)
        FSDP_MESHES.append((list(out.mesh_dim_names), list(out.shape)))
        return out

    meshes.dp_mesh = dp_mesh


class _Collect(logging.Handler):
    def emit(self, record):
        if record.levelno == logging.WARNING:
            TORCH_WARNINGS.append((record.name, record.getMessage().splitlines()[0][:200]))


def rewind(src: str, dst: str, tag: str) -> None:
    """A copy of run ``src`` whose latest checkpoint is ``tag`` (the later ones removed)."""
    shutil.copytree(src, dst)
    ckpt = Path(dst) / "checkpoints"
    for d in ckpt.iterdir():
        if d.is_dir() and d.name > tag:
            shutil.rmtree(d)
    (ckpt / "latest").write_text(tag + "\n")


def one_run(spec: dict) -> dict:
    from megafixed.config import load_config
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.trainer import train

    cfg = load_config(None, spec["overrides"])
    if spec.get("rewind") and int(os.environ["RANK"]) == 0:
        rewind(spec["rewind"][0], cfg.train.run_dir, spec["rewind"][1])
    if dist.is_initialized():
        dist.barrier()
    if spec.get("inject"):
        cfg.faults.inject = spec["inject"]
    JUDGED.clear()
    TORCH_WARNINGS.clear()
    FSDP_MESHES.clear()
    lines: list = []
    topo = setup_distributed(RunPlan.for_launch(cfg))
    result = train(cfg, topo, log=lines.append)
    mine = {"judged": list(JUDGED), "warnings": list(TORCH_WARNINGS)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    judged = [e["judged"] for e in every]
    return {"describe": topo.plan.describe(), "step": result.step, "resumed_from": result.resumed_from,
            "lines": lines, "judged": judged[0], "ranks": len(judged),
            "fsdp_meshes": sorted({json.dumps(m) for m in FSDP_MESHES}),
            "same_bits_on_every_rank": all(j == judged[0] for j in judged),
            "sequential_all_reduce_warnings": sum("sequential all_reduce" in m for e in every
                                                  for _, m in e["warnings"])}


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    runs = json.loads(Path(spec_path).read_text())["runs"]
    spy_on_the_guard()
    spy_on_the_fsdp_mesh()
    logging.getLogger("torch").addHandler(_Collect())
    results: dict = {}
    for spec in runs:  # the first run's setup_distributed starts the world; later ones keep it
        if spec.get("inject") and dist.get_rank() == 0:  # the victim ends this launch: write first
            Path(out_path).write_text(json.dumps(results, indent=1))
        results[spec["name"]] = one_run(spec)
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
