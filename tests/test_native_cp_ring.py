"""Ring attention (``parallel.cp_method=ring``) in the torch engine, on CPU with the ring emulated
(``native_cp_ring_worker.py``): a CP2 ring run of ``megafixed train`` equals the CP2 Ulysses run in the same
world (which tests/test_native_cp.py holds equal to one process): losses, gradient norms and validation
losses within 1e-5, and its attention went through torch's ring wrapper on this rank's half of each sequence."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from _env import launch_free_env
from _launch import torchrun_cmd
from _metrics import assert_rows_match, read_metrics
from _train_data import tiny_overrides, write_shards

ROOT = Path(__file__).resolve().parent.parent
RUN = ("train.engine=torch", "train.max_steps=4", "checkpoint.interval=2", "checkpoint.keep=0",
       "validation.interval=2", "schedule.warmup_steps=1", "optimizer.grad_clip=0.05", "model.vocab_size=512",
       "model.code_bits=9", "model.input=gf2", "parallel.cp=2")


@pytest.mark.multiprocess
def test_a_cp2_ring_run_equals_the_cp2_ulysses_run(tmp_path):
    prefix = write_shards(tmp_path / "data")
    runs = [{"name": m, "overrides": tiny_overrides(prefix, tmp_path / m, *RUN, f"parallel.cp_method={m}")}
            for m in ("ulysses", "ring")]
    (tmp_path / "spec.json").write_text(json.dumps({"runs": runs}))
    cmd = torchrun_cmd(2, [str(ROOT / "tests" / "native_cp_ring_worker.py"), str(tmp_path / "spec.json"),
                           str(tmp_path / "out.json")])
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_free_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert re.search(r"ring attention: local q \(4, 4, 16, 16\) of \(4, 4, 32, 16\)", proc.stderr)
    out = json.loads((tmp_path / "out.json").read_text())
    assert all(out[m]["same_bits_on_every_rank"] for m in ("ulysses", "ring"))
    ring, ulysses = read_metrics(tmp_path / "ring", "loss"), read_metrics(tmp_path / "ulysses", "loss")
    assert [r["step"] for r in ring] == [1, 2, 3, 4]
    assert_rows_match(ring, ulysses, "ring vs ulysses", rtol=1e-5)
    vals = [(r["step"], r["val_loss"]) for r in read_metrics(tmp_path / "ring", "val_loss")]
    want = [(r["step"], r["val_loss"]) for r in read_metrics(tmp_path / "ulysses", "val_loss")]
    assert [s for s, _ in vals] == [s for s, _ in want] and len(vals) >= 2
    assert all(v == pytest.approx(w, rel=1e-5) for (_, v), (_, w) in zip(vals, want))
