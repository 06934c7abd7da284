"""Logic of code paths only a GPU runs, exercised on CPU (the suite has no GPU, see test_gpu_check.py):

* MFU peaks by exact device name: PCIe/NVL parts are not given the SXM peak; unknown -> no MFU;
* the CUDA RNG state of the rank's own device is saved and restored (older list-form states too);
* batches bound for CUDA are pinned first (a non_blocking copy from pageable memory is synchronous);
* the async checkpoint's host snapshot is an independent, contiguous copy, and the writer's fence
  orders nothing when no CUDA copy is in flight.
"""
from __future__ import annotations

import pytest
import torch

from megafixed.parallel import device_specs


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.5), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100-PCIE-40GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA B200", 2250.0)])
def test_peak_table_by_exact_device_name(name, tflops, monkeypatch):
    monkeypatch.delenv("MEGAFIXED_PEAK_TFLOPS", raising=False)
    assert device_specs.peak_bf16_flops(name) == tflops * 1e12


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "NVIDIA H100", "NVIDIA H200 NVL 2", "NVIDIA L40S",
                                  "NVIDIA H800", "", None])
def test_unknown_devices_have_no_peak_and_no_mfu(name, monkeypatch):
    from megafixed.bench.train import _Loop, _stats
    from megafixed.train import metrics

    monkeypatch.delenv("MEGAFIXED_PEAK_TFLOPS", raising=False)
    assert device_specs.peak_bf16_flops(name) is None and device_specs.hbm_bandwidth(name) is None
    # what `megafixed train` and `bench train` ask for on a GPU of that name
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert metrics.peak_flops_per_gpu() is None
    loop = _Loop(torch.device("cpu"))
    loop.times = [0.5, 0.4]
    assert _stats(loop, 1000, 6e9, metrics.peak_flops_per_gpu(), 1)["mfu"] is None
    monkeypatch.setenv("MEGAFIXED_PEAK_TFLOPS", "100")  # by hand, for a part not in the table
    assert metrics.peak_flops_per_gpu() == 100e12


def test_cuda_rng_state_is_the_ranks_own_device(monkeypatch):
    from megafixed.train import checkpoint

    states = {i: torch.full((8,), i, dtype=torch.uint8) for i in range(4)}
    restored = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # this process computes on CUDA
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[device].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.__setitem__(device, s))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("saved every visible GPU's state"))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: pytest.fail("restored every GPU's state"))
    saved = checkpoint.rng_state()
    assert torch.equal(saved["cuda"], states[2])
    checkpoint.set_rng_state(saved)
    assert list(restored) == [2] and torch.equal(restored[2], states[2])
    # an older checkpoint: one state per GPU the rank saw; resumed where it sees fewer
    restored.clear()
    checkpoint.set_rng_state({**saved, "cuda": [states[0], states[1], states[3]]})
    assert torch.equal(restored[2], states[3])
    restored.clear()
    checkpoint.set_rng_state({**saved, "cuda": [states[1]]})
    assert torch.equal(restored[2], states[1])


def test_batches_for_cuda_are_pinned_before_the_copy(monkeypatch):
    from megafixed.engine.batches import pinned_for

    tokens = torch.arange(12).reshape(2, 6)
    assert pinned_for(tokens, "cpu") is tokens  # nothing to do on a CPU run
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self.clone())
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: any(self is p for p in pinned))
    out = pinned_for(tokens, torch.device("cuda", 0))
    assert len(pinned) == 1 and pinned[0] is tokens and torch.equal(out, tokens) and out is not tokens
    assert pinned_for(tokens, "cuda") is tokens  # already pinned: no second copy


def test_async_snapshot_is_an_independent_contiguous_copy():
    from megafixed.engine.deepspeed.async_save import CheckpointWriter, HostCopier, snapshot

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"w": base, "wt": base.t(), "row": base[1], "nested": [base[:, 2], (1, "x")], "step": 7}
    copier = HostCopier()
    snap = snapshot(state, copier)
    base.mul_(-1)  # training goes on changing the live state
    assert torch.equal(snap["w"], torch.arange(24.).reshape(4, 6))
    assert torch.equal(snap["wt"], torch.arange(24.).reshape(4, 6).t()) and snap["wt"].is_contiguous()
    assert snap["row"].untyped_storage().nbytes() == 6 * 4  # a view became its own tensor
    assert snap["nested"][1] == (1, "x") and snap["step"] == 7
    assert copier.event() is None  # nothing was queued on a GPU stream
    writer = CheckpointWriter(async_save=True)
    writer.fence()  # no copy in flight: orders nothing, needs no GPU
