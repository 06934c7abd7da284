"""The tests' one reader of a run's ``metrics.jsonl`` and one per-step comparison of two runs.

Written here, not through ``RunDirectory.read_metrics``: the tests check what the product wrote
with a reader of their own. Rows: step 0's validation (``val_loss``, ``consumed_samples``), then
one per logged training step (``loss``, ``lr``, ``grad_norm``, ... and ``val_loss`` when it ran).
"""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Optional

from _train_data import REFERENCE_STEPS

RTOL = 1e-5  # fp32 runs of one model under two layouts: summation order alone differs


def read_metrics(run_dir: str | os.PathLike, has: Optional[str] = None, *, missing_ok: bool = False) -> list[dict]:
    """The run's records in order; ``has="loss"``: the training steps' only, ``has="val_loss"``:
    the validations' only. A finished run's file: every line must be whole JSON. ``missing_ok``:
    ``[]`` when the run has written no file yet (else that is an error)."""
    path = Path(run_dir) / "metrics.jsonl"
    if missing_ok and not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if has is None or has in r]


def logged_step(run_dir: str | os.PathLike) -> int:
    """The last step a run still writing has logged (0: none yet); a line being written is skipped."""
    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)


def assert_rows_match(got: list[dict], want: list[dict], what: str, keys=("loss", "grad_norm"),
                      rtol: float = RTOL) -> None:
    """Row by row the same steps and, per ``keys``, values within ``rtol`` (0: the same bits)."""
    assert [r["step"] for r in got] == [r["step"] for r in want], f"{what}: steps differ"
    for a, b in zip(got, want, strict=True):
        for key in keys:
            same = a[key] == b[key] if rtol == 0 else math.isclose(a[key], b[key], rel_tol=rtol)
            assert same, f"{what}: step {a['step']} {key} {a[key]} vs {b[key]}"


def assert_matches(run_dir, ref_dir, what: str, steps: int = REFERENCE_STEPS, rtol: float = RTOL) -> None:
    """``run_dir`` logged steps 1..``steps`` with the loss and gradient norm of ``ref_dir``'s
    (a single-process reference of at least that many steps) at the same steps."""
    got, ref = read_metrics(run_dir, "loss"), read_metrics(ref_dir, "loss")[:steps]
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, steps + 1)), what
    assert_rows_match(got, ref, what, rtol=rtol)


def raw_scalars(tb_dir: Path) -> dict:
    """Every scalar event in the files, as written (no TensorBoard purge logic applied)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out = defaultdict(list)
    for path in sorted(tb_dir.rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                v = float(tensor_util.make_ndarray(value.tensor)) if value.HasField("tensor") else value.simple_value
                out[value.tag].append((event.step, v))
    return out
