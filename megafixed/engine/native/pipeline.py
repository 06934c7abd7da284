"""Pipeline parallelism in the torch engine: ``torch.distributed.pipelining`` stages and schedules.

torchtitan's composition, on the meta device until the end::

    meta_gpt(cfg.model)  -> apply_float8      the blocks' Linears in float8 (train.float8), as without PP
    -> apply_tp (whole meta GPT; no memory)   DTensor TP/SP, as without PP
    -> apply_cp (whole meta GPT)              Ulysses attention (parallel.cp > 1), as without PP
    -> split              this rank's stages (schedules.stage_spans / stage_ids), global names
    -> AC, compile        per block, in place
    -> fully_shard        per block and head, then each stage module as its own root (dp > 1),
                          reshard_after_forward off (the schedule interleaves microbatches)
    -> materialize        only this rank's parameters, single-process values
    -> PipelineStage x vpp and the library's schedule class (``parallel.pp_schedule``)

TP is applied to the whole meta GPT before the split rather than per stage after it: on the meta
device that costs nothing and is the same module-by-module transformation (torchtitan applies it
per stage only because its plan names stage-local modules), while our one TP plan keeps
addressing ``blocks.N`` by index.

``PipelineParts`` is what the rest of the engine sees as the model: one ``nn.Module`` holding this
rank's input / blocks / head under the plain-GPT names (``blocks.N`` in a ``ModuleDict`` keyed by
the global index), so DCP's state dict, the optimizer's parameter groups and ``materialize`` are
the non-pipeline ones and checkpoints do not depend on the split. The stage modules
(``StageModule``) are views onto the same submodules; the FSDP2 roots are the stage modules (the
schedule drives their gradient sync: one reduce-scatter per step, after the last microbatch).

The numerics are one process's: each microbatch's loss is the sum of its token losses divided by
this rank's token count per step (``microbatch_loss`` below; the schedule's own ``scale_grads`` is off),
FSDP2 averages over the data-parallel ranks, so the gradient is the mean over the global batch;
the gradient norm is one all-reduce over the whole job (each pp rank holds other parameters) before
clipping.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from .schedules import StageSpan

# ----------------------------------------------------------------------------------- the modules


class StageModule(nn.Module):
    """One pipeline stage of the GPT: [input] -> blocks -> [head]; the blocks keep their global index.

    ``GPT.forward`` runs it (from the ids or from the hidden states sent by the stage before, over
    this stage's blocks, with or without the head): one block loop for the model and its stages."""

    def __init__(self, gpt, span: StageSpan):
        super().__init__()
        self.span = span
        if span.has_input:
            self.input = gpt.input
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in span.blocks})
        if span.has_head:
            self.head = gpt.head
        # A plain attribute, not a submodule: this stage's parameters are its own modules' only.
        self._gpt_forward = gpt.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.span.has_input
        out = self._gpt_forward(x if first else None, hidden=None if first else x, layers=self.span.blocks,
                                head=self.span.has_head)
        from torch.distributed.tensor import DTensor

        # vocabulary-split DTensor logits under TP: a stage passes plain tensors; the loss rebuilds it
        return out.to_local() if isinstance(out, DTensor) else out


class PipelineParts(nn.Module):
    """This rank's stages as one module under the plain-GPT names (for DCP, the optimizer, init)."""

    def __init__(self, gpt, spans: list[StageSpan]):
        super().__init__()
        self.cfg = gpt.cfg
        if any(s.has_input for s in spans):
            self.input = gpt.input
        self.rotary = gpt.rotary
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for s in spans for i in s.blocks})
        if any(s.has_head for s in spans):
            self.head = gpt.head
        self.loss_fn = gpt.loss_fn  # the vocabulary-parallel one under TP (tensor.loss_context reads it)


# ----------------------------------------------------------------------------------- building
def _apply_fsdp_stage(stage: StageModule, mesh, precision: str) -> None:
    """FSDP2 per block and head, then the stage as its root; nothing resharded after forward: the
    schedule runs several microbatches' forwards before their backwards (torchtitan's PP rule)."""
    from torch.distributed.fsdp import fully_shard

    from .mesh import dp_mesh
    from .precision import mixed_precision_policy

    kwargs = dict(mesh=dp_mesh(mesh), mp_policy=mixed_precision_policy(precision), reshard_after_forward=False)
    for block in stage.blocks.values():
        fully_shard(block, **kwargs)
    if stage.span.has_head:
        fully_shard(stage.head, **kwargs)
    fully_shard(stage, **kwargs)


def build_stages(cfg, topo):
    """(parts, stage modules, stage ids) of this rank: meta -> TP -> split -> AC/compile -> FSDP2 -> init."""
    from ...model.gpt import meta_gpt
    from .context import apply_cp, shards_state
    from .float8 import apply_float8
    from .materialize import materialize
    from .schedules import is_v_shaped, stage_ids, stage_spans

    plan = topo.plan
    gpt = meta_gpt(cfg.model)
    apply_float8(gpt, cfg, topo)  # before TP and FSDP2, as build.build_model
    if plan.tp > 1:
        from .tensor import apply_tp

        apply_tp(gpt, topo.mesh["tp"], sequence_parallel=plan.sequence_parallel)
    apply_cp(gpt, cfg, topo)
    set_input_dtype(gpt, plan)
    gpt.activation_checkpointing = bool(cfg.train.activation_checkpointing)  # GPT.forward runs every stage
    own = plan.engine_plan
    spans = stage_spans(cfg.model.n_layers, plan.pp * own.vpp, own.pp_input_head_layers)
    ids = stage_ids(topo.pp_rank, plan.pp, own.vpp, is_v_shaped(own.pp_schedule))
    stages = [StageModule(gpt, spans[i]) for i in ids]
    for stage in stages:
        if cfg.train.compile:
            for block in stage.blocks.values():
                block.compile()
        if shards_state(plan):
            _apply_fsdp_stage(stage, topo.mesh, plan.precision)
    parts = PipelineParts(gpt, [spans[i] for i in ids])
    materialize(parts, cfg.model, cfg.train.seed, topo.device, topo.init_device)
    return parts, stages, ids


def hidden_dtype(cfg, plan) -> torch.dtype:
    """The dtype of the hidden states one stage sends the next (sender and receiver must agree on it).

    fp32 trains in fp32. Under FSDP2 (dp > 1) the weights are cast to the 16-bit dtype, and so is
    everything they make. One data-parallel rank has no FSDP: it runs under autocast over fp32 weights,
    where the residual stream keeps the input's dtype -- the fixed code's, written in the 16-bit dtype
    (``set_input_dtype``), or a learned table's fp32 (autocast leaves an embedding lookup in its
    weight's dtype) -- since each block adds its 16-bit output to it without changing its dtype."""
    from ...model.interfaces import interface_of
    from ..dtypes import COMPUTE_DTYPES

    if plan.precision == "fp32":
        return torch.float32
    if plan.dp * plan.cp > 1 or interface_of(cfg.model).has_code:  # build.shards_state: FSDP2 casts
        return COMPUTE_DTYPES[plan.precision]
    return torch.float32


def set_input_dtype(gpt, plan) -> None:
    """A fixed-code input writes its codes in the compute dtype (a constant +-scale loses nothing)."""
    from ..dtypes import COMPUTE_DTYPES

    if gpt.has_fixed_input and plan.precision != "fp32":
        gpt.input.out_dtype = COMPUTE_DTYPES[plan.precision]


def _activation_meta(cfg, plan, span: StageSpan, *, output: bool) -> torch.Tensor:
    """The (meta) tensor a stage receives or sends per microbatch: token ids into the first stage,
    ``[mb, T/(cp*sp), d]`` activations between stages (``hidden_dtype``), the (vocabulary-split) logits out
    of the last (16-bit from the head's matmul under autocast or FSDP2's cast alike)."""
    from ..dtypes import COMPUTE_DTYPES

    mb, seq = plan.batch.micro_batch, plan.batch.seq_len // plan.cp  # this rank's context-parallel slice
    dtype = COMPUTE_DTYPES[plan.precision] if plan.precision != "fp32" else torch.float32
    if not output and span.has_input:
        return torch.empty(mb, seq, dtype=torch.long, device="meta")
    # requires_grad: the stage derives from it that a gradient comes back for this tensor
    if output and span.has_head:
        return torch.empty(mb, seq, cfg.model.vocab_size // plan.tp, dtype=dtype, device="meta", requires_grad=True)
    local_seq = seq // plan.tp if plan.sequence_parallel else seq
    return torch.empty(mb, local_seq, cfg.model.d_model, dtype=hidden_dtype(cfg, plan), device="meta",
                       requires_grad=True)


def microbatch_loss(parts, plan, tp_mesh, n_microbatches: int) -> Callable:
    """A schedule's ``loss_fn(output, target)`` over ``n_microbatches`` microbatches: one microbatch's
    summed token losses over the tokens of all of them, so that the microbatches' losses add up to
    the per-token mean (and, in training, the accumulated gradient is the step's per-token mean)."""
    tokens = plan.batch.micro_batch * n_microbatches * plan.batch.seq_len // plan.cp  # this rank's CP slice

    def loss_fn(output, target):
        if tp_mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            output = DTensor.from_local(output, tp_mesh, [Shard(-1)], run_check=False)
        return parts.loss_fn(output, target) * (target.numel() / tokens)

    return loss_fn


def build_schedule(cfg, topo, stages, ids, n_microbatches: int, loss_fn: Callable, *, forward_only: bool = False):
    """The library's schedule class (``parallel.pp_schedule``) over ``n_microbatches`` microbatches, on
    a ``PipelineStage`` of its own for each of this rank's stage modules (a stage keeps the receive
    buffers and the forward/backward set-up of the one microbatch count its schedule runs).

    ``forward_only``: an evaluation schedule, of the class that takes any microbatch count on this
    stage layout (``schedules.forward_only_schedule``) and with only the forward actions of its table."""
    from torch.distributed.pipelining import PipelineStage

    from .schedules import forward_only_schedule, is_multi_stage, schedule_class

    plan = topo.plan
    own = plan.engine_plan
    name = forward_only_schedule(own.pp_schedule) if forward_only else own.pp_schedule
    n_stages = plan.pp * own.vpp
    group = topo.mesh["pp"].get_group()
    pipe_stages = [PipelineStage(m, i, n_stages, topo.device, group=group,
                                 input_args=_activation_meta(cfg, plan, m.span, output=False),
                                 output_args=_activation_meta(cfg, plan, m.span, output=True))
                   for m, i in zip(stages, ids)]
    held = pipe_stages if is_multi_stage(name) else pipe_stages[0]
    schedule = schedule_class(name)(held, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if forward_only and is_multi_stage(name):
        _keep_forward_actions(schedule)
    return schedule


def _keep_forward_actions(schedule) -> None:
    """Drop the backward actions (and their sends, receives and gradient reductions) from a
    multi-stage schedule's lowered action table, keeping the forward ones in their order.

    torch 2.13's runtime runs a table's backward actions in ``eval()`` too, as no-ops, except that on
    a V, where a rank holds two adjacent stages, it then hands the stage before an input gradient
    that does not exist (an AssertionError). Dropping actions only drops waits, so the forward pass
    keeps the schedule's deadlock-free order."""
    from torch.distributed.pipelining.schedules import FORWARD, RECV_F, RESHARD, SEND_F, UNSHARD

    kept = (FORWARD, SEND_F, RECV_F, UNSHARD, RESHARD)
    schedule.pipeline_order_with_comms = {rank: [a for a in actions if a.computation_type in kept]
                                          for rank, actions in schedule.pipeline_order_with_comms.items()}


# ----------------------------------------------------------------------------------- numerics
def pp_grad_norm(parameters, pp_group) -> torch.Tensor:
    """The whole model's gradient L2 norm under PP: ``step.grad_norm``'s one all-reduce over the
    whole job sums the pipeline ranks' distinct parameters too; ``pp_group`` is that job when the
    stages hold plain tensors (no TP, no DP)."""
    from .step import grad_norm

    return grad_norm(parameters, group=pp_group)


def pp_loss_mean(local: torch.Tensor, topo) -> tuple[float, bool]:
    """The step's global-batch loss and its non-finite flag from this rank's summed microbatch
    losses (zero off the last stage), in ONE all-reduce over the whole job, so that every rank --
    every stage, TP and DP peer -- holds the same bits for the bad-step guard (a pp all-reduce
    followed by a DP one per tensor-parallel column would be hops through different communicators).
    The last stage's ``tp`` peers hold equal copies: the sum is divided by ``dp * tp``; its ``cp`` peers
    hold the means of equal slices of the same sequences, so their sum is divided by ``cp`` too."""
    stats = torch.stack([torch.nan_to_num(local, nan=0.0, posinf=0.0, neginf=0.0),
                         (~torch.isfinite(local)).double()]).double()
    from .mesh import job_group

    group = job_group(topo.mesh)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    from ..batches import host_values

    total, bad = host_values(stats)  # one read of both (fake-safe: plan --fake runs this step)
    nonfinite = bad > 0
    return (float("nan") if nonfinite else total / (topo.dp * topo.tp * topo.cp)), nonfinite
