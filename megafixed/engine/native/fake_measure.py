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

Under pipeline parallelism (one stage per rank) the engine's own pipeline build and schedule run
instead (``pipeline_step.build_pipeline_engine``), its sends and receives the fake group's no-ops;
``fake_worker`` measures the first and the last stage's ranks.

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
    return Topology(world_size=plan.world_size, rank=rank, local_rank=0, tp=plan.tp, pp=plan.pp, dp=plan.dp,
                    sequence_parallel=plan.sequence_parallel, tp_rank=at["tp"], pp_rank=at["pp"], dp_rank=at["dp"],
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


def _pipeline_step(engine, inputs, labels, tracker) -> None:
    """``PipelineEngine.train_step``'s tensor work: the schedule over this rank's ``accum``
    microbatches (sends and receives are the fake group's no-ops, the received tensors fake), the
    pp-summed grad norm and the optimizer step."""
    from .pipeline import pp_grad_norm

    tracker.reset_mod_stats()
    losses = [] if engine.has_last else None
    with engine._loss_context(engine.model), engine._compute()():
        engine.schedule.step(*((inputs,) if engine.has_first else ()), target=labels if engine.has_last else None,
                             losses=losses, return_outputs=False)
    params = [p for group in engine.optimizer.param_groups for p in group["params"]]
    pp_grad_norm(params, engine.pp_group)
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)


def _pipeline_tracker(engine):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    root = engine.stages[0]  # vpp = 1: the rank's one stage, its FSDP2 root when dp > 1
    if isinstance(root, FSDPModule):
        tracker = FSDPMemTracker(root, engine.optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(engine.model, engine.optimizer)
    # The schedule runs the stage's forward once per microbatch, which the per-module stats refuse
    # without a reset in between (the peak is kept across resets). A global hook, registered before
    # the tracker's own (which it adds on entering), so the reset comes before the tracker records
    # this forward, not between its pre- and post-forward hooks.
    from torch.nn.modules.module import register_module_forward_pre_hook

    tracker._megafixed_reset = register_module_forward_pre_hook(
        lambda module, _args: tracker.reset_mod_stats() if module is root else None)
    return tracker


def measure_step(cfg, topo) -> dict:
    """Build this rank's model and optimizer for ``topo`` and run ``STEPS`` steps; the peak bytes
    by part, and the last step's collectives with their bytes (on this rank). Under pipeline
    parallelism, this rank's stage through the engine's own schedule."""
    from .comm_bytes import CommBytesMode

    b, s = topo.plan.batch.micro_batch, cfg.data.seq_len
    gen = torch.Generator().manual_seed(cfg.train.seed + topo.dp_rank)
    if topo.pp > 1:  # the schedule takes the step's microbatches as one batch and splits it
        from .pipeline_step import build_pipeline_engine

        engine = build_pipeline_engine(cfg, topo)
        tracker = _pipeline_tracker(engine)
        b *= topo.plan.batch.accum
        step = lambda: _pipeline_step(engine, inputs, labels, tracker)  # noqa: E731
    else:
        from ...run.optim import build_optimizer
        from .build import build_model

        model = build_model(cfg, topo)
        optimizer = build_optimizer(model, cfg.optimizer)
        tracker = _tracker(model, optimizer)
        step = lambda: _one_step(model, optimizer, topo, inputs, labels, topo.plan.batch.accum, tracker)  # noqa: E731
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=gen)
    inputs, labels = tokens[:, :-1].to(topo.device), tokens[:, 1:].to(topo.device)
    comm = None
    try:
        with tracker:
            for i in range(STEPS):
                comm = CommBytesMode() if i == STEPS - 1 else contextlib.nullcontext()
                with comm:
                    step()
    finally:
        if hasattr(tracker, "_megafixed_reset"):
            tracker._megafixed_reset.remove()
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


@contextlib.contextmanager
def _pipeline_warmup_vote_decided_locally():
    """torch's pipeline schedules (2.12 on) open with a vote over the stages, STATIC (every stage was
    given its shapes) or DYNAMIC, passed along by point-to-point sends and read with ``.item()``,
    which a fake tensor cannot answer. Every stage of our pipeline is built with its shapes
    (``pipeline.build_schedule``), so the vote's outcome is each stage's own: decided here, locally,
    as the library would. Older torch has no vote, and nothing is patched."""
    from torch.distributed.pipelining import schedules

    base = schedules._PipelineSchedule
    original = getattr(base, "_warmup_p2p", None)
    if original is None:
        yield
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def decided_locally(self, stages, has_backward, p2p_done):
        static = not any(InferenceMode.needs_dynamic(stage._user_meta, has_backward) for stage in stages)
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC if static else InferenceMode.DYNAMIC

    base._warmup_p2p = decided_locally
    try:
        yield
    finally:
        base._warmup_p2p = original


@contextlib.contextmanager
def _plain_parameters_replaced_on_to_empty():
    """``to_empty`` swaps each parameter in place (``torch.utils.swap_tensors``) when the new one is
    a fake tensor, and a meta parameter the fake mode has already seen carries the converter's weakref,
    which the swap refuses ("Couldn't swap RMSNorm.weight"). A model with no DTensor parameter
    (no FSDP2 or TP: a pipeline stage on dp 1, a lone GPU) gets new Parameters instead, as
    ``to_empty`` with ``torch.__future__``'s overwrite switch would; nothing holds them yet
    (``materialize`` runs before the optimizer is built)."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    original = nn.Module.to_empty

    def to_empty(self, *, device, recurse=True):
        if not recurse or any(isinstance(p, DTensor) for p in self.parameters()):
            return original(self, device=device, recurse=recurse)
        for module in self.modules():
            for key, p in module._parameters.items():
                if p is not None:
                    module._parameters[key] = nn.Parameter(torch.empty_like(p, device=device),
                                                           requires_grad=p.requires_grad)
            for key, b in module._buffers.items():
                if b is not None:
                    module._buffers[key] = torch.empty_like(b, device=device)
        return self

    nn.Module.to_empty = to_empty
    try:
        yield
    finally:
        nn.Module.to_empty = original


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
        with (FakeTensorMode(allow_non_fake_inputs=True), _mesh_slicing_outside_fake_mode(),
              _sharding_propagation_in_its_own_fake_mode(), _pipeline_warmup_vote_decided_locally(),
              _plain_parameters_replaced_on_to_empty()):
            out = measure_step(cfg, topo)
    finally:
        dist.destroy_process_group()
    out["seconds"] = time.perf_counter() - started
    return out
