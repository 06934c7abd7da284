"""Tiny real token shards for the trainer tests (written with the data package's ShardWriter).

Documents follow a learnable rule (each token = previous + a per-document stride, mod 256), so a
two-layer model's loss falls within a few dozen steps; the bytes are fixed by the seed.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

VOCAB = 256
TINY_MODEL = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.code_bits=8",
              "model.max_seq_len=32", "data.seq_len=32"]


def write_shards(root: str | os.PathLike, docs: int = 400, seed: int = 0) -> str:
    from megafixed.data.indexed import ShardWriter

    prefix = str(Path(root) / "synthetic")
    rng = np.random.default_rng(seed)
    with ShardWriter(prefix, np.uint16) as w:
        for _ in range(docs):
            n = int(rng.integers(20, 120))
            start, stride = int(rng.integers(0, VOCAB)), int(rng.choice([1, 3, 7]))
            w.add_document((start + stride * np.arange(n)) % VOCAB)
        w.finalize({"vocab_size": VOCAB})
    return prefix


def tiny_overrides(prefix: str, run_dir: str | os.PathLike, *extra: str) -> list[str]:
    return TINY_MODEL + [f"data.prefixes=[{prefix}]", "data.split=90,5,5", f"train.run_dir={run_dir}",
                         "train.global_batch=8", "train.micro_batch=4", "metrics.interval=1",
                         "validation.interval=10", "validation.iters=2", "checkpoint.interval=10",
                         "metrics.tensorboard=false", "optimizer.lr=3e-3", "optimizer.min_lr=3e-4",
                         "schedule.warmup_steps=3", *extra]


# The 4-step, checkpoint-every-2 run that several files compare layouts, resumes and checkpoints
# against (tests/test_parallel_train.py, test_ckpt_universal.py, test_ckpt_integrity.py); one
# session fixture (conftest.tiny_reference) trains it once per input kind for all of them.
REFERENCE_STEPS = 4
REFERENCE_EXTRA = (f"train.max_steps={REFERENCE_STEPS}", "checkpoint.interval=2", "validation.interval=0",
                   "schedule.warmup_steps=1")


def reference_overrides(prefix: str, run_dir: str | os.PathLike, kind: str, *extra: str) -> list[str]:
    return tiny_overrides(prefix, run_dir, f"model.input={kind}", *REFERENCE_EXTRA, *extra)
