"""Peak memory per rank of one DeepSpeed training step, measured on real tensors.

DeepSpeed cannot run under fake tensors (``planner.fake_refusal``), so its analytic model
(``parallel.memory.estimate`` with this engine's planner) is checked against this: the engine's own
build (``build.build``) and step (``DeepSpeedEngine.train_step``) on real ranks -- two CPU gloo ranks in
tests/test_deepspeed_memory.py -- under torch's ``MemTracker``, two steps (the first creates Adam's
state; the second is the steady one), as ``plan --fake`` measures the torch engine.

Why the tracker is not simply entered around the steps with ``track_external(model, optimizer)``:
``deepspeed.initialize`` allocates most of what ZeRO holds -- the flat 16-bit parameters, the fp32
master partitions (the inner optimizer's parameters, not its state), the fp32 gradient accumulators
(ZeRO-1) or partition (ZeRO-3), ZeRO-3's partitions and bucket -- and ``track_external`` of the module
and the optimizer sees only parameters, gradients and optimizer state: at ZeRO-1 bf16 it missed 10 of
the 34 MB of the small test model. So every tensor storage the build made (the live tensors, found
by ``gc``, whose storage did not exist before it) is handed to the tracker first, counted as "Other";
the module's parameters and buffers and the optimizer's state are then relabelled by
``track_external``. From there on the tracker labels each allocation itself (gradients, activations,
backward temporaries, optimizer state), as in the fake measurement.
"""
from __future__ import annotations

import gc
from typing import Iterator

import torch

STEPS = 2  # the second step is measured: the first creates the optimizer state


def _live_tensors() -> list[torch.Tensor]:
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def _storage(t: torch.Tensor):
    """``t``'s storage, or None for one that holds no memory (meta, empty, storage-less kinds)."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return st if st.nbytes() and st.device.type != "meta" else None


def _new_tensors(before: dict) -> list[torch.Tensor]:
    """The live tensors whose storage is not one of ``before``'s (address -> storage, held, so that
    none was freed and its address reused meanwhile)."""
    out = []
    for t in _live_tensors():
        st = _storage(t)
        if st is not None and st.data_ptr() not in before:
            out.append(t)
    return out


def _micro_batches(cfg, topo, tracker, step: int) -> Iterator[torch.Tensor]:
    """This rank's micro batches of one step (token rows ``[mb, seq + 1]``, seeded by step and DP rank);
    the tracker's module statistics are reset before each, as its per-module stats refuse a second
    root forward (the peak is kept)."""
    batch = topo.plan.batch
    gen = torch.Generator().manual_seed(cfg.train.seed * 1000 + step * 64 + topo.dp_rank)
    for _ in range(batch.accum):
        tracker.reset_mod_stats()
        yield torch.randint(0, cfg.model.vocab_size, (batch.micro_batch, cfg.data.seq_len + 1), generator=gen)


def measure_step(cfg, topo, precision: str) -> dict:
    """Build this rank's DeepSpeed engine for ``cfg`` (its ``zero.stage``) in ``precision`` and train
    ``STEPS`` steps; the peak bytes on this rank's device, in all and by the tracker's label."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from .build import build

    before = {st.data_ptr(): st for st in map(_storage, _live_tensors()) if st is not None}
    engine = build(cfg, topo, topo.plan.batch, precision)
    made = _new_tensors(before)
    tracker = MemTracker()
    tracker.track_external(*made)  # "Other": DeepSpeed's flat partitions, accumulators, buckets
    tracker.track_external(engine.module, engine.optimizer)  # relabelled: parameters, buffers, optimizer state
    del made, before
    with tracker:
        for step in range(STEPS):
            engine.train_step(_micro_batches(cfg, topo, tracker, step), cfg.optimizer.lr, step + 1)
    peak = tracker.get_tracker_snapshot("peak")
    device_peak = peak.get(topo.device) or max(peak.values(), key=lambda d: d.get("Total", 0))
    parts = {getattr(k, "value", str(k)): int(v) for k, v in device_peak.items() if k != "Total"}
    return {"peak_bytes": int(device_peak["Total"]), "parts": parts}
