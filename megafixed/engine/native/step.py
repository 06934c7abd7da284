"""One optimizer step and one validation pass of the torch engine.

The DeepSpeed engine's numerics, in torch: each micro batch's loss is scaled by ``1 / accum``
before its backward (DeepSpeed's gradient-accumulation scaling), FSDP2 reduce-scatters each micro
batch's gradients over the shard axis into fp32 shards, as torchtitan does -- holding the
unsharded fp32 gradients until the last micro batch would cost a full fp32 copy of the model per
rank between reductions -- and all-reduces those shards over the replicate axis (HSDP's, plain
replication's) once, after the last micro batch (``_reduce_replicas``), the global gradient norm is
taken over the whole mesh before clipping (the norm DeepSpeed reports), and the reported loss is the
mean over micro batches and DP ranks with one non-finite flag every rank agrees on
(``engine.batches.dp_mean_and_flag``).

The step is fake-safe: every read of a device value onto the host goes through
``batches.host_values``, so ``megafixed plan --fake`` runs this very step under ``FakeTensorMode``
(``fake_measure.py``) and measures what ``megafixed train`` runs.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Optional

import torch

from ..base import StepResult
from ..batches import host_values
from ..loops import accumulated_loss, eval_mean, loss_verdict, norm_verdict, scaled_loss
from .ring import whole_batch


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (a DTensor loss under TP is replicated: its local value is all of it)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def compute_context(model, precision: str, device) -> Callable:
    """What the forward runs in: nothing for fp32, or for a model FSDP2 casts itself
    (``MixedPrecisionPolicy``); else ``torch.autocast`` to the 16-bit dtype -- one data-parallel rank
    has no FSDP, and its bf16 must still be bf16 compute over fp32 weights and fp32 gradients
    (torchtitan's ``maybe_enable_amp`` draws the same line)."""
    from torch.distributed.fsdp import FSDPModule

    from ..dtypes import COMPUTE_DTYPES

    if precision == "fp32" or isinstance(model, FSDPModule):
        return contextlib.nullcontext
    kind, dtype = torch.device(device).type, COMPUTE_DTYPES[precision]
    return lambda: torch.autocast(kind, dtype=dtype)


def grad_norm(parameters, group=None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, each parameter counted once across the job, in ONE
    all-reduce over every rank of it: the same bits on every rank, which the bad-step guard relies on.

    Each rank sums the squares of its own distinct parts (``_distinct_locals``: a shard counts where
    it lives, a replica only at coordinate 0 of each dimension it is replicated over, a pipeline
    stage's parameters on that stage) and the sums are all-reduced over the job: the group of the
    gradients' root mesh (``mesh.job_group``), or ``group`` for plain gradients (a pipeline without
    TP or DP); plain gradients and no ``group``: one process, no collective. DTensor's own norm
    (``get_total_norm`` over DTensors) reduces one mesh dimension after another -- two sequential
    all-reduces on a ``(dp_shard, tp)`` mesh, a third over pp -- through different communicators,
    which neither promises every rank the same bits nor costs a single collective's latency
    (torchtitan and Megatron-LM take such hops too). A flattened mesh would merge DTensor's
    reductions but still leave the pipeline's.

    The DeepSpeed engine's norm (``deepspeed.grad_norm.global_grad_norm``) is the same number over
    plain megatron-core tensors, counted by their ``tensor_model_parallel`` mark: a different
    mechanism, said there, so the two are not one function."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    params = list(parameters)
    grads = _replicated_partials([p for p in params if p.grad is not None])
    meshes = [g.device_mesh for g in grads if isinstance(g, DTensor)]
    reduce = bool(meshes) or group is not None
    if meshes:
        from .mesh import job_group

        group = job_group(meshes[0])
    local = _distinct_locals(grads)
    device = params[0].device if params else torch.device("cpu")
    if local:
        squares = torch.nn.utils.get_total_norm(local, norm_type=2.0).double().square()
    else:
        squares = torch.zeros((), dtype=torch.float64, device=device)
    if reduce and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, group=group)  # every rank of the job, once: identical bits everywhere
    return squares.sqrt()


def _replicated_partials(params) -> list:
    """Every gradient, with the ones DTensor leaves ``Partial`` (a replicated norm weight under
    sequence parallelism with no FSDP to reduce it) summed in place: one all-reduce per mesh
    dimension for all of them together, where AdamW would otherwise reduce each one on every use."""
    from torch.distributed.tensor import DTensor, Replicate

    pending: dict = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            pending.setdefault((g.device_mesh, tuple(g.placements)), []).append(p)
    for (mesh, placements), group in pending.items():
        import torch.distributed as dist

        locals_ = [p.grad.to_local() for p in group]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim, pl in enumerate(placements):
            if pl.is_partial():
                if pl.reduce_op not in ("sum", "avg"):
                    raise RuntimeError(f"a {pl} gradient: only sum and avg partials are reduced here")
                dist.all_reduce(flat, group=mesh.get_group(dim))
                if pl.reduce_op == "avg":
                    flat /= mesh.size(dim)
        done = [Replicate() if pl.is_partial() else pl for pl in placements]
        offset = 0
        for p, t in zip(group, locals_):
            part = flat[offset:offset + t.numel()].view_as(t)
            offset += t.numel()
            p.grad = DTensor.from_local(part, mesh, done, run_check=False, shape=p.grad.shape,
                                        stride=p.grad.stride())
    return [p.grad for p in params]


def _distinct_locals(grads) -> list:
    """This rank's share of the gradients, counted once across the job: the local tensor of every
    DTensor whose replicated mesh dimensions this rank is at coordinate 0 of, and the plain
    gradients where every DTensor mesh here has this rank at its origin (a plain gradient is
    replicated over all of them: only the pipeline splits such parameters across ranks)."""
    from torch.distributed.tensor import DTensor

    out, origin = [], True
    plain = []
    for g in grads:
        if not isinstance(g, DTensor):
            plain.append(g)
            continue
        coord = g.device_mesh.get_coordinate() or [0] * g.device_mesh.ndim
        origin = origin and not any(coord)
        if all(c == 0 for c, pl in zip(coord, g.placements) if pl.is_replicate()):
            out.append(g.to_local())
    return out + (plain if origin else [])


def clip_(parameters, max_norm: float, total: float) -> None:
    """Scale the gradients to ``max_norm`` when ``total`` exceeds it (torch's and DeepSpeed's rule),
    on the local tensors, one fused multiply per device and dtype (DTensor gradients scale locally)."""
    if max_norm <= 0 or not math.isfinite(total):
        return
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        from torch.distributed.tensor import DTensor

        groups: dict = {}
        for p in parameters:
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                groups.setdefault((g.device, g.dtype), []).append(g)
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)


def train_step(model, optimizer, batches: Iterator[torch.Tensor], accum: int, *, lr: float, dp: int, dp_group,
               grad_clip: float, on_nonfinite: str = "stop", step: int = 0, vocab_size: Optional[int] = None,
               device=None, loss_context: Callable = lambda _m: contextlib.nullcontext(),
               precision: str = "fp32", hook=None, shard: tuple[int, int] = (0, 1),
               batch_context: Callable = whole_batch) -> StepResult:
    """One optimizer step over ``accum`` micro batches of this rank (``batches``; under context
    parallelism its ``shard`` = (cp rank, cp) of each)."""
    model.train()
    device = device if device is not None else next(model.parameters()).device
    compute = compute_context(model, precision, device)

    def micro_step(k: int, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # this micro batch's gradients reduce-scattered by its own backward; the replicas' all-reduce
        # only at the last (``_reduce_replicas``)
        _reduce_replicas(model, last=k == accum - 1)
        with batch_context(model, inputs, labels) as batch, loss_context(model):
            with compute():
                loss = scaled_loss(model(batch.inputs, batch.labels), hook, step)  # faults.inject, if set
            (loss / accum).backward()
        return _plain(loss)

    value, nonfinite = accumulated_loss(batches, accum, micro_step, device=device, vocab_size=vocab_size,
                                        dp=dp, dp_group=dp_group, shard=shard)
    return apply_update(optimizer, value, nonfinite, lr=lr, grad_clip=grad_clip, on_nonfinite=on_nonfinite, step=step,
                        hook=hook)


def _reduce_replicas(model, *, last: bool) -> None:
    """Whether this micro batch's backward all-reduces the gradient shards over the replicate axis.

    Every micro batch reduce-scatters over the shard axis (that keeps the gradients sharded); the
    all-reduce across replicas buys no memory, so it runs once, after the last micro batch: before
    it, FSDP2 (``set_requires_all_reduce(False)``) adds each reduce-scattered shard into a partial
    sum of the shard's size, which the last backward's all-reduce then reduces. torchtitan
    accumulates HSDP's gradients so; the result is the same mean. A 1-D FSDP mesh has no replicate
    axis and ignores the flag; under PP the pipeline schedule drives FSDP2 itself (no reduction at
    all until its last microbatch, ``pipelining``'s ``backward_maybe_with_nosync``)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(last)


def apply_update(optimizer, value: float, nonfinite: bool, *, lr: float, grad_clip: float, on_nonfinite: str,
                 step: int, norm: Callable = grad_norm, hook=None) -> StepResult:
    """The step's end, after the backward of every micro batch: the bad-step verdict, the global
    gradient norm (``norm``: the pipeline's sums it over the pp group too), clipping, AdamW.

    The guard judges the reduced loss and the global norm, identical on every rank (no collective, no
    device read of its own: both values are read here anyway). A dropped update: torch has no step to
    turn into a no-op; not calling it and dropping the gradients leaves weights and optimizer state
    untouched (DeepSpeed's engine needs SkippableAdamW)."""
    verdict = loss_verdict(hook, step, value, nonfinite, on_nonfinite)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    total = float(host_values(norm(params))) if verdict is None else None
    verdict = verdict or norm_verdict(hook, step, total)
    if verdict is not None:
        optimizer.zero_grad(set_to_none=True)
        return StepResult(loss=value, grad_norm=None, skipped=True, verdict=verdict)  # the batch is dropped
    clip_(params, grad_clip, total)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=value, grad_norm=total if math.isfinite(total) else None, skipped=False)


@torch.no_grad()
def eval_loss(model, batches: Iterator[torch.Tensor], iters: int, *, dp: int, dp_group, vocab_size=None,
              device=None, loss_context: Callable = lambda _m: contextlib.nullcontext(),
              precision: str = "fp32", shard: tuple[int, int] = (0, 1),
              batch_context: Callable = whole_batch) -> float:
    """Mean loss over ``iters`` micro batches per rank, averaged over data-parallel ranks (``dp_group``:
    dp x cp under context parallelism, each rank on its ``shard`` of the sequences)."""
    if iters < 1:
        return float("nan")
    was_training = model.training
    model.eval()
    device = device if device is not None else next(model.parameters()).device
    compute = compute_context(model, precision, device)

    def forward(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with batch_context(model, inputs, labels) as batch, loss_context(model), compute():
            return _plain(model(batch.inputs, batch.labels))

    try:
        return eval_mean(batches, iters, forward, device=device, vocab_size=vocab_size, dp=dp, dp_group=dp_group,
                         shard=shard)
    finally:
        model.train(was_training)
