"""The soak's verdict on its final weights (``tools/soak.py``'s ``final_weights_compared``): it compares the
soaked run's final checkpoint with the reference's, so a pair that differs must be called different."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import soak  # noqa: E402


def _run_dir(root: Path, name: str, tag: str) -> Path:
    run_dir = root / name
    (run_dir / "checkpoints" / tag).mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text(tag + "\n")
    return run_dir


@pytest.fixture
def pair(tmp_path):
    soaked = _run_dir(tmp_path, "soaked", "step_00000008")
    reference = _run_dir(tmp_path, "reference", "step_00000008")
    return soaked, reference


def test_final_weights_that_differ_are_called_different(pair):
    soaked, reference = pair
    states = {soaked: {"w": torch.zeros(3), "b": torch.ones(2)}, reference: {"w": torch.zeros(3), "b": torch.zeros(2)}}
    same, tensors, differ = soak.final_weights_compared(soaked, reference, read=lambda tag: states[tag.parent.parent])
    assert (same, tensors, differ) == (False, 2, ["b"])


def test_equal_final_weights_are_bit_identical_and_a_missing_tensor_differs(pair):
    soaked, reference = pair
    states = {soaked: {"w": torch.arange(3.0)}, reference: {"w": torch.arange(3.0)}}
    assert soak.final_weights_compared(soaked, reference, read=lambda t: states[t.parent.parent]) == (True, 1, [])
    states[reference]["extra"] = torch.zeros(1)
    assert soak.final_weights_compared(soaked, reference, read=lambda t: states[t.parent.parent])[2] == ["extra"]


def test_each_side_is_read_from_its_own_latest_tag(tmp_path):
    soaked = _run_dir(tmp_path, "soaked", "step_00000008")
    reference = _run_dir(tmp_path, "reference", "step_00000006")
    read = []
    soak.final_weights_compared(soaked, reference, read=lambda t: read.append(t) or {"w": torch.zeros(1)})
    assert read == [soaked / "checkpoints" / "step_00000008", reference / "checkpoints" / "step_00000006"]
