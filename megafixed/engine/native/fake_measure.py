"""Peak memory and traffic per rank of one torch-engine training step, at full size, with no GPU.

torchtitan's estimator (``scripts/estimate/estimation.py``) made ours: the run's own build
(``build.build_model``: meta -> TP/SP -> activation checkpointing -> FSDP2/HSDP -> materialize ->
the run's optimizer) runs under ``FakeTensorMode`` on rank 0 of a fake process group of the
planned world size (``torch.testing._internal.distributed.fake_pg``: every collective returns at
once, nothing is sent), so the shapes, dtypes, shards and collectives are the real ones and no byte
is allocated. Two steps run (the first creates Adam's state; the second is the steady one whose
peak a long run sees) under ``FSDPMemTracker``, which labels every live tensor (sharded and
unsharded params, grads, optimizer state, activations, temporaries); ``CommBytesMode`` counts the
second step's collectives with their bytes.

``measure_step`` takes any process group and any tensors, so the same function run really on two
gloo processes is the check that the fake run is right (tests/test_fake_measure.py).
"""
from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import torch

STEPS = 2  # the second step is measured: the first creates the optimizer state


def check_measurable(plan) -> str | None:
    """Why this plan's step cannot be measured under fake tensors here, or None."""
    if plan.pp > 1:
        return "pipeline parallelism is not measured under fake tensors yet (parallel.pp must be 1)"
    try:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: F401
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except ImportError as e:  # private modules: torch may move them
        return f"torch {torch.__version__} lacks what --fake needs ({e}); use torch 2.6 or later"
    return None


def topology(cfg, plan, rank: int, device: torch.device):
    """A ``Topology`` for ``plan`` on an initialised process group, its mesh built on ``device``
    (the fake run sizes a GPU plan on CPU tensors: shapes and dtypes are the plan's either way)."""
    from ...parallel.topology import Topology
    from .mesh import build_mesh, dp_submesh

    shape = SimpleNamespace(dp=plan.dp, tp=plan.tp, pp=plan.pp, device=device)
    mesh = build_mesh(shape, plan.dp_replicate)
    at = plan.dims.coords(rank)
    return Topology(world_size=plan.world_size, rank=rank, local_rank=0, tp=plan.tp, pp=1, dp=plan.dp,
                    sequence_parallel=plan.sequence_parallel, tp_rank=at["tp"], dp_rank=at["dp"],
                    device=device, backend="fake", plan=plan, mesh=mesh, tp_group=mesh["tp"].get_group(),
                    dp_group=dp_submesh(mesh).get_group(), model_parallel_group=mesh["tp"].get_group())


def _tracker(model, optimizer):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return FSDPMemTracker(model, optimizer)
    tracker = MemTracker()  # one DP rank: no FSDP2 to instrument
    tracker.track_external(model, optimizer)
    return tracker


def _one_step(model, optimizer, topo, inputs, labels, accum: int, tracker) -> None:
    """``step.train_step``'s tensor work (forward, backward per micro batch, the global grad norm,
    the optimizer step) without its Python scalars, which fake tensors
    have no value for."""
    from . import step

    compute = step.compute_context(model, topo.plan.precision, topo.device)
    loss_context = contextlib.nullcontext
    if topo.tp > 1:
        from .tensor import loss_context as tp_loss

        loss_context = lambda: tp_loss(model)  # noqa: E731
    for _ in range(accum):
        tracker.reset_mod_stats()  # its per-module stats refuse a second root forward; the peak is kept
        # FSDP2's default, as step.train_step: each micro batch's backward reduce-scatters its gradients
        with loss_context():
            with compute():
                loss = model(inputs, labels)
            (loss / accum).backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    step.grad_norm(params)  # its all-reduce is part of the step's traffic
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_step(cfg, topo) -> dict:
    """Build this rank's model and optimizer for ``topo`` and run ``STEPS`` steps; the peak bytes
    by part, and the last step's collectives with their bytes (on this rank)."""
    from ...run.optim import build_optimizer
    from .build import build_model
    from .comm_bytes import CommBytesMode

    model = build_model(cfg, topo)
    optimizer = build_optimizer(model, cfg.optimizer)
    b, s = topo.plan.batch.micro_batch, cfg.data.seq_len
    gen = torch.Generator().manual_seed(cfg.train.seed + topo.dp_rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=gen)
    inputs, labels = tokens[:, :-1].to(topo.device), tokens[:, 1:].to(topo.device)
    tracker = _tracker(model, optimizer)
    comm = None
    with tracker:
        for i in range(STEPS):
            comm = CommBytesMode() if i == STEPS - 1 else contextlib.nullcontext()
            with comm:
                _one_step(model, optimizer, topo, inputs, labels, topo.plan.batch.accum, tracker)
    peak = tracker.get_tracker_snapshot("peak")
    device_peak = max(peak.values(), key=lambda d: d.get("Total", 0)) if peak else {}
    parts = {str(k): int(v) for k, v in device_peak.items() if str(k) != "Total"}
    return {"peak_bytes": int(device_peak.get("Total", 0)), "parts": parts, "comm": comm.summary()}


@contextlib.contextmanager
def _mesh_slicing_outside_fake_mode():
    """A DeviceMesh made inside the fake mode (FSDP2's 2-D DP x TP mesh, ``DeviceMesh._concatenate``;
    slices) computes its coordinates with ``nonzero`` on its rank tensor, which a fake tensor cannot
    answer (its output shape depends on the values); the ranks are real, so a mesh is made with the
    fake mode set aside."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def real_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = real_init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


@contextlib.contextmanager
def _sharding_propagation_in_its_own_fake_mode():
    """DTensor's sharding propagation (its uncached path: the first step's ``_foreach_norm`` over
    every gradient) builds global-shape tensors in the active fake mode, or in a fresh one when there
    is none, as in a real run. Borrowing ours, the tracker counted them as memory: the whole model in
    fp32 (6.4 GiB at 1.7B) that no real step allocates. A fresh mode per propagation, as eager has,
    keeps them out (the tracker skips every mode but the one it entered in)."""
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


def measure_fake(cfg, plan) -> dict:
    """``measure_step`` for rank 0 of ``plan`` under ``FakeTensorMode`` on a fake process group of
    ``plan.world_size`` (initialised here: one per process, so one plan per process)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    started = time.perf_counter()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        topo = topology(cfg, plan, 0, torch.device("cpu"))  # outside the mode: the mesh reads real ranks
        with (FakeTensorMode(allow_non_fake_inputs=True), _mesh_slicing_outside_fake_mode(),
              _sharding_propagation_in_its_own_fake_mode()):
            out = measure_step(cfg, topo)
    finally:
        dist.destroy_process_group()
    out["seconds"] = time.perf_counter() - started
    return out
