"""The model, its parallelisms and its optimizer, for one rank of a torch-engine run.

torchtitan's order, on the meta device until the end::

    meta_gpt(cfg.model)                       the plain GPT: names, shapes, no memory
    -> float8.apply_float8                    the blocks' Linears -> torchao Float8Linear (train.float8)
    -> tensor.apply_tp(model, mesh["tp"])     DTensor TP/SP from the one TP plan (parallel.tp > 1)
    -> apply_cp                               Ulysses attention over mesh["cp"] (parallel.cp > 1)
    -> activation checkpointing, compile      per block, in place (parameter names stay the GPT's)
    -> fully_shard per block, the head, root  FSDP2 over mesh["dp_shard"] (HSDP: 2-D) when dp > 1;
                                              over dp_shard x cp ("dp_shard_cp") when cp > 1
    -> materialize                            this rank's shards get the single-process values
    -> build_optimizer                        AdamW with the same parameter groups as DeepSpeed's

One data-parallel rank (and no CP) gets no FSDP at all: a plain module (or TP's DTensors) trains as it is,
with no all-gather on a one-rank mesh to pay for.
"""
from __future__ import annotations

from ...run.optim import build_optimizer
from ..dtypes import COMPUTE_DTYPES
from .context import apply_cp, shards_state
from .float8 import apply_float8, float8_all_gather, precompute_scales_after_step
from .materialize import materialize
from .precision import mixed_precision_policy  # noqa: F401  (its home was here)


def apply_fsdp(model, mesh, *, precision: str, reshard_after_forward: bool) -> None:
    """``fully_shard`` each block and the head (one all-gather / reduce-scatter group each), then
    the root (the input table, anything left). A tied head is the input table, which must stay in
    one group with it: it is then left to the root."""
    from torch.distributed.fsdp import fully_shard

    from .mesh import dp_mesh

    shard_mesh = dp_mesh(mesh)
    kwargs = dict(mesh=shard_mesh, mp_policy=mixed_precision_policy(precision))
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    if not model.cfg.tie_embeddings:
        # The head runs last in forward and first in backward: resharding it would only free what
        # backward gathers again at once (torchtitan keeps its last group gathered the same way).
        fully_shard(model.head, reshard_after_forward=False, **kwargs)
    # The root's own default (no reshard after forward): its parameters are the first needed in backward.
    fully_shard(model, **kwargs)


def build_model(cfg, topo):
    """This rank's model (meta -> TP -> AC/compile -> FSDP2 -> materialized), for ``topo.plan``."""
    from ...model.gpt import meta_gpt

    plan = topo.plan
    model = meta_gpt(cfg.model)
    apply_float8(model, cfg, topo)  # before TP and FSDP2 (torchtitan's order): they wrap Float8Linear
    if plan.tp > 1:
        from .tensor import apply_tp

        apply_tp(model, topo.mesh["tp"], sequence_parallel=plan.sequence_parallel)
    apply_cp(model, cfg, topo)
    if model.has_fixed_input and plan.precision != "fp32":
        model.input.out_dtype = COMPUTE_DTYPES[plan.precision]  # the code is exactly +-scale in any float dtype
    # GPT.forward checkpoints each block itself (non-reentrant), around FSDP2's hooks of the block:
    # the recomputation runs inside its backward unshard, as with torchtitan's per-block wrapper.
    model.activation_checkpointing = bool(cfg.train.activation_checkpointing)
    if cfg.train.compile:
        for block in model.blocks:
            # In place (Module.compile): parameter names, and so checkpoints, stay the GPT's. Dynamo
            # leaves FSDP2's hooks to run eagerly around the compiled block (skip_fsdp_hooks).
            block.compile()
    if shards_state(plan):
        apply_fsdp(model, topo.mesh, precision=plan.precision,
                   reshard_after_forward=cfg.torch_engine.reshard_after_forward)
    materialize(model, cfg.model, cfg.train.seed, topo.device, topo.init_device)
    return model


def build(cfg, topo, hook=None):
    """A ``NativeEngine`` for this rank of the run (``topo`` from ``setup_distributed``: its mesh);
    ``hook``: the ``StepHook`` its step asks (None: none)."""
    from .engine import NativeEngine

    if topo.mesh is None and topo.world_size > 1:  # a caller bug: the topology of another engine
        raise RuntimeError("train.engine=torch needs the Topology setup_distributed builds for it (with its mesh)")
    if topo.plan.pp > 1:  # the pipeline's stages and schedule (pipeline.py, pipeline_step.py)
        from .pipeline_step import build_pipeline_engine

        return build_pipeline_engine(cfg, topo, hook)
    model = build_model(cfg, topo)
    optimizer = build_optimizer(model, cfg.optimizer)
    if cfg.train.float8 != "off" and float8_all_gather(cfg, topo.plan):
        precompute_scales_after_step(model, optimizer)
    return NativeEngine(model, optimizer, cfg=cfg, topo=topo, hook=hook)
