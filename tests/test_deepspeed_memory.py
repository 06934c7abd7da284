"""The DeepSpeed engine's analytic memory model against its real step, ZeRO 1, 2 and 3.

DeepSpeed cannot run under fake tensors (``planner.fake_refusal``), so ``megafixed plan``'s DeepSpeed
rows are checked here against the engine's own build and step really run on 2 CPU gloo ranks in
bf16 under torch's ``MemTracker`` (``engine/deepspeed/measure_memory.py``; one launch, a fresh engine
per stage). The model is small, but chosen so that no part dwarfs the others: model states ~24 MB,
activations ~8 MB, DeepSpeed's gradient bucket 2 MB (``zero.reduce_bucket_size``, smaller than the
model, so it is reduced during the backward as in a large model) and ZeRO-3's gathered and persistent
parameters ~6 MB; two micro batches per step, so the fp32 accumulation is in it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megafixed.config import load_config
from megafixed.engines import engine_kind
from megafixed.parallel.memory import estimate

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "deepspeed_memory_worker.py")
SMALL = ["model.vocab_size=512", "model.d_model=256", "model.n_layers=2", "model.n_heads=4",
         "model.max_seq_len=128", "data.seq_len=128", "model.code_bits=9", "train.global_batch=8",
         "train.micro_batch=2", "train.seed=7", "zero.reduce_bucket_size=1000000"]
STAGES = (1, 2, 3)
PRECISION = "bf16"  # DeepSpeed's CPU accelerator runs bf16 (its BF16 optimizer at ZeRO 1, ZeRO's at 2-3)
RTOL = 0.10


@pytest.fixture(scope="module")
def measured(tmp_path_factory, torchrun) -> dict:
    out = tmp_path_factory.mktemp("ds_memory") / "out.json"
    torchrun(2, [WORKER, str(out), PRECISION, ",".join(map(str, STAGES)), *SMALL])
    return {int(stage): ranks for stage, ranks in json.loads(out.read_text()).items()}


def _analytic(stage: int):
    """What ``megafixed plan`` prints for this row (TP 1, PP 1, DP 2), less the reserve."""
    cfg = load_config(None, [*SMALL, "train.engine=deepspeed", f"zero.stage={stage}"])
    planner = engine_kind("deepspeed").planner
    layout = planner.make_layout(cfg, 1, 1, 2, stage, cfg.train.micro_batch, False, "parameters")
    return estimate(cfg.model, cfg.data.seq_len, layout, PRECISION)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", STAGES)
def test_analytic_deepspeed_memory_within_10_percent_of_the_real_step(measured, stage):
    est = _analytic(stage)
    for rank, got in enumerate(measured[stage]):
        # DeepSpeed's own buffers were seen (the flat partitions made by deepspeed.initialize)
        assert got["parts"]["Other"] > 0, got
        assert est.tensors == pytest.approx(got["peak_bytes"], rel=RTOL), \
            f"zero {stage} rank {rank}: analytic {est.tensors / 2**20:.2f} MiB, measured " \
            f"{got['peak_bytes'] / 2**20:.2f} MiB ({got['parts']})"
