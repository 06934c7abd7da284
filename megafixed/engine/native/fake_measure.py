"""Peak memory and traffic per rank of one torch-engine training step, at full size, with no GPU.

torchtitan's estimator (``scripts/estimate/estimation.py``) made ours: the run's own engine
(``build.build``: meta -> TP/SP -> activation checkpointing -> FSDP2/HSDP -> materialize -> the
run's optimizer, or the pipeline's stages and schedule) is built under ``FakeTensorMode`` on one
rank of a fake process group of the planned world size (``torch.testing._internal.distributed.
fake_pg``: every collective returns at once, nothing is sent), and its own ``train_step`` runs --
the step ``megafixed train`` runs, fake-safe because it reads device values only through
``engine.batches.host_values``. So the shapes, dtypes, shards, the micro-batch loop and its
collectives are the real ones, and no byte is allocated. Two steps run (the first creates Adam's
state; the second is the steady one whose peak a long run sees) under ``FSDPMemTracker``, which
labels every live tensor (sharded and unsharded params, grads, optimizer state, activations,
temporaries); ``CommBytesMode`` counts the second step's collectives with their bytes, by kind and
by mesh axis. The torch internals that assume real tensors are patched only while their phase
runs (``fake_patches``).

Under pipeline parallelism (one stage per rank) the engine's schedule runs, its sends and receives
the fake group's no-ops; ``fake_worker`` measures the first and the last stage's ranks.

``measure_step`` takes any process group and any tensors, so the same function run really on four
gloo processes is the check that the fake run is right (tests/test_fake_measure.py).
"""
from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import torch

from .fake_patches import fake_patches

STEPS = 2  # the second step is measured: the first creates the optimizer state


def check_measurable(plan) -> str | None:
    """Why this plan's step cannot be measured under fake tensors here, or None."""
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
    from .mesh import build_mesh, mesh_groups

    shape = SimpleNamespace(dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp, device=device)
    mesh = build_mesh(shape, plan.engine_plan.dp_replicate)
    return Topology(plan=plan, rank=rank, local_rank=0, device=device, backend="fake", **mesh_groups(mesh))


def _tracker(engine):
    """The memory tracker of the engine's model: ``FSDPMemTracker`` on its FSDP2 root (a pipeline
    rank's one stage, vpp = 1), else the plain ``MemTracker`` (one DP rank: no FSDP2 to instrument)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    root = engine.stages[0] if hasattr(engine, "stages") else engine.model
    if isinstance(root, FSDPModule):
        tracker = FSDPMemTracker(root, engine.optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(engine.model, engine.optimizer)
    # The step runs the root's forward once per micro batch, which the per-module stats refuse
    # without a reset in between (the peak is kept across resets). A global hook, registered before
    # the tracker's own (which it adds on entering), so the reset comes before the tracker records
    # this forward, not between its pre- and post-forward hooks.
    from torch.nn.modules.module import register_module_forward_pre_hook

    tracker._megafixed_reset = register_module_forward_pre_hook(
        lambda module, _args: tracker.reset_mod_stats() if module is root else None)
    return tracker


def measure_step(cfg, topo, fake: bool = False) -> dict:
    """Build this rank's engine for ``topo`` (``build.build``: what ``megafixed train`` builds) and
    run ``STEPS`` of its own ``train_step``; the peak bytes by part, and the last step's collectives
    with their bytes (on this rank), by kind and by mesh axis. Under pipeline parallelism, this
    rank's stage through the engine's own schedule. ``fake``: under ``FakeTensorMode``, with the
    patches that its phases need (``fake_patches``)."""
    from .build import build
    from .comm_bytes import CommBytesMode

    gen = torch.Generator().manual_seed(cfg.train.seed + topo.dp_rank)
    patches = fake_patches if fake else lambda *_a, **_k: contextlib.nullcontext()
    with patches("build", pp=topo.pp):
        engine = build(cfg, topo)
    tracker = _tracker(engine)
    b, s, accum = topo.plan.batch.micro_batch, cfg.data.seq_len, topo.plan.batch.accum
    # the step's micro batches, as the data loader hands them: [mb, seq + 1] token ids
    batches = [torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=gen) for _ in range(accum)]
    axes = _axis_groups(topo.mesh)
    comm, steps = None, []
    try:
        with tracker, patches("step", pp=topo.pp):
            for i in range(STEPS):
                comm = CommBytesMode(axes) if i == STEPS - 1 else contextlib.nullcontext()
                with comm:
                    steps.append(engine.train_step(iter(batches), cfg.optimizer.lr, i))
    finally:
        tracker._megafixed_reset.remove()
    peak = tracker.get_tracker_snapshot("peak")
    device_peak = max(peak.values(), key=lambda d: d.get("Total", 0)) if peak else {}
    parts = {str(k): int(v) for k, v in device_peak.items() if str(k) != "Total"}
    out = {"peak_bytes": int(device_peak.get("Total", 0)), "parts": parts, "comm": comm.summary(),
           "comm_by_axis": comm.by_axis()}
    if not fake:  # a real run's numbers (a fake step's are its stand-ins: host_values)
        out["steps"] = [{"loss": r.loss, "grad_norm": r.grad_norm} for r in steps]
    return out


def _axis_groups(mesh) -> dict:
    """{process group name: mesh axis} for the axes a step's collectives run on (``parallel.traffic``'s
    names); the flattened data-parallel group is ``dp`` (the loss mean)."""
    from .mesh import dp_submesh

    if mesh is None:
        return {}
    out = {dp_submesh(mesh).get_group().group_name: "dp"}
    for axis in mesh.mesh_dim_names:
        out[mesh[axis].get_group().group_name] = axis
    return out


def measure_fake(cfg, plan, rank: int = 0) -> dict:
    """``measure_step`` for ``rank`` of ``plan`` under ``FakeTensorMode`` on a fake process group of
    ``plan.world_size`` (initialised here and torn down after)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    started = time.perf_counter()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        topo = topology(cfg, plan, rank, torch.device("cpu"))  # outside the mode: the mesh reads real ranks
        with FakeTensorMode(allow_non_fake_inputs=True):
            out = measure_step(cfg, topo, fake=True)
    finally:
        dist.destroy_process_group()
    out["seconds"] = time.perf_counter() - started
    return out
