"""Several ``megafixed train`` runs of the torch engine in ONE world (tests/test_native_cp.py): a
torchrun world of context-parallel layouts, or (started with plain ``python``) one process running
the references, so each world pays its imports once for all of its runs.

Each run is what ``megafixed train`` does after its imports -- ``train(cfg, setup_distributed(
RunPlan.for_launch(cfg)))`` -- one after another. A run may start from a copy of an earlier run's
directory rewound to one of its checkpoints (a resume at another layout), and may carry a drill
(``faults.inject``; ``exit@N`` SIGKILLs every rank mid-run, which ends the launch: results so far are
written first). On every rank the bad-step guard's inputs (the reduced loss and the global gradient
norm) are recorded bit for bit; rank 0 writes, per run, whether every rank saw the same bits::

    torchrun --nproc-per-node 4 tests/native_cp_worker.py SPEC.json OUT.json
    python tests/native_cp_worker.py SPEC.json OUT.json

SPEC.json: ``{"runs": [{"name": .., "overrides": [..], "rewind": [SRC_RUN_DIR, TAG] | null,
"inject": "exit@3" | null}, ...]}``.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch.distributed as dist  # noqa: E402

JUDGED: list = []  # (step, what, value's bits) as this rank's guard was asked


def bits(x) -> str:
    return "none" if x is None else struct.pack("<d", float(x)).hex()


def spy_on_the_guard() -> None:
    from megafixed.train.callbacks.guard.verdict import BadStepGuard

    real = BadStepGuard.judge

    def judge(self, step, what, value):
        JUDGED.append((step, what, bits(value)))
        return real(self, step, what, value)

    BadStepGuard.judge = judge


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
    if spec.get("rewind") and int(os.environ.get("RANK", "0")) == 0:
        rewind(spec["rewind"][0], cfg.train.run_dir, spec["rewind"][1])
    if dist.is_initialized():
        dist.barrier()
    if spec.get("inject"):
        cfg.faults.inject = spec["inject"]
    JUDGED.clear()
    lines: list = []
    topo = setup_distributed(RunPlan.for_launch(cfg))
    result = train(cfg, topo, log=lines.append)
    every = [list(JUDGED)]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, list(JUDGED))
    return {"describe": topo.plan.describe(), "step": result.step, "resumed_from": result.resumed_from,
            "lines": lines, "judged": every[0], "ranks": len(every),
            "same_bits_on_every_rank": all(j == every[0] for j in every)}


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    runs = json.loads(Path(spec_path).read_text())["runs"]
    spy_on_the_guard()
    results: dict = {}
    for spec in runs:  # the first run's setup_distributed starts the world; later ones keep it
        if spec.get("inject") and int(os.environ.get("RANK", "0")) == 0:  # the victim ends this launch
            Path(out_path).write_text(json.dumps(results, indent=1))
        t0 = time.perf_counter()
        results[spec["name"]] = one_run(spec)
        results[spec["name"]]["wall_s"] = round(time.perf_counter() - t0, 2)
        if dist.is_initialized():
            dist.barrier()
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    if dist.is_initialized():
        dist.barrier()
    # as `megafixed train` leaves (commands/train.py): no library teardown at exit, which has been seen to
    # SIGABRT ("terminate called without an active exception") after runs that all finished
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
