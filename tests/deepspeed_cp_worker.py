"""Several ``megafixed train`` runs of the DeepSpeed engine in ONE gloo world (tests/test_deepspeed_cp.py).

Each run is what ``megafixed train`` does after its imports -- ``train(cfg, setup_distributed(
RunPlan.for_launch(cfg)))`` -- one after another in the same world, so the ranks pay their imports
once for all of them; between runs megatron-core's ``parallel_state`` is reset, so each run makes
its own TP/CP/DP groups as a fresh launch would. A run may start from a copy of another run
directory rewound to one of its checkpoints (a resume at another layout), and may carry a drill
(``faults.inject``: ``exit@N`` SIGKILLs every rank mid-run, which ends this launch; the test reruns
the same command). After each run rank 0 writes the plan's description, the step reached, the
checkpoint it resumed from and the lines it logged:

    torchrun --nproc-per-node N tests/deepspeed_cp_worker.py SPEC.json OUT.json

SPEC.json: ``{"runs": [{"name": .., "overrides": [..], "rewind": [SRC_RUN_DIR, TAG] | null,
"inject": "exit@4" | null}, ...]}``.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch.distributed as dist  # noqa: E402


def rewind(src: str, dst: str, tag: str) -> None:
    """A copy of run ``src`` whose latest checkpoint is ``tag`` (the later ones removed)."""
    shutil.copytree(src, dst)
    ckpt = Path(dst) / "checkpoints"
    for d in ckpt.iterdir():
        if d.is_dir() and d.name > tag:
            shutil.rmtree(d)
    (ckpt / "latest").write_text(tag + "\n")


def reset_groups() -> None:
    """What a fresh launch starts without: megatron-core's groups, and the model-parallel unit DeepSpeed
    keeps from the last engine that was given one (``deepspeed.utils.groups.mpu``, which a later engine
    without one -- a run without TP or CP -- would otherwise still ask)."""
    from deepspeed.utils import groups

    from megafixed.engine.deepspeed.megatron_tp import load

    ps = load().parallel_state
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    groups.mpu = None


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
        reset_groups()
    if spec.get("inject"):
        cfg.faults.inject = spec["inject"]
    lines: list = []
    topo = setup_distributed(RunPlan.for_launch(cfg))
    result = train(cfg, topo, log=lines.append)
    return {"describe": topo.plan.describe(), "step": result.step, "resumed_from": result.resumed_from,
            "lines": lines}


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    runs = json.loads(Path(spec_path).read_text())["runs"]
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
