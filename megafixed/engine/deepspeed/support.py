"""What the DeepSpeed engine refuses by name, checked by the run plan before any process group (and
on a login node for ``--dry-run``); imports nothing heavy.

The ZeRO rules live here rather than in the engine-agnostic layout validator
(``megafixed.parallel.layout``): ``zero.*`` means nothing to the torch-native engine (FSDP2 shards
instead), so only a DeepSpeed run is held to them.
"""
from __future__ import annotations

from ...config import ConfigError
from ...parallel.layout import LayoutError


def check_supported(cfg, plan) -> None:
    pp = plan.pp
    if cfg.train.float8 != "off":
        # torchao's Float8Linear under FSDP2/DTensor is the torch engine's; DeepSpeed's ZeRO and its
        # megatron-core TP layers have no float8 route here.
        raise ConfigError(f"train.float8={cfg.train.float8} is not supported by train.engine=deepspeed; "
                          f"set train.engine=torch, or train.float8=off")
    if cfg.train.compile and pp > 1:
        # DeepSpeed's pipeline engine runs its stages' layers through its own schedule (activation
        # checkpointing, p2p buffers); compiling them is untested there, and silently running eager
        # would make `train.compile=true` a lie.
        raise ConfigError(f"train.compile=true is not supported with pipeline parallelism (parallel.pp="
                          f"{pp}); set train.compile=false, or parallel.pp=1")
    check_context_parallel(plan)
    from ...config_checks import check_pipeline_keys_need_pp

    check_pipeline_keys_need_pp(cfg, pp)
    schedule, vpp = str(cfg.parallel.pp_schedule), cfg.parallel.vpp
    if pp > 1 and (schedule.lower() != "1f1b" or vpp != 1):
        # Its pipeline engine has one schedule (1F1B, one stage per rank); running it under another
        # name would not be what was asked. train.engine=torch runs torch.distributed.pipelining's.
        raise ConfigError(f"train.engine=deepspeed runs the 1F1B pipeline schedule only (one stage per rank), "
                          f"not parallel.pp_schedule={schedule} with parallel.vpp={vpp}; set "
                          f"parallel.pp_schedule=1F1B parallel.vpp=1, or train.engine=torch")
    if getattr(cfg.model, "fused_first_layer", False) and (plan.tp > 1 or pp > 1):
        # Its TP swaps the q/k/v Linears for megatron-core layers, and its pipeline runs the stages'
        # layers without GPT.forward; the torch engine runs the fused layer at every layout.
        raise LayoutError(f"model.fused_first_layer=true runs under train.engine=deepspeed for the plain model "
                          f"only (parallel.tp=1, parallel.pp=1; data parallelism and ZeRO are fine), got "
                          f"tp={plan.tp}, pp={pp}; set model.fused_first_layer=false, or train.engine=torch")
    check_zero(cfg, pp, plan.precision)


def check_zero(cfg, pp: int, precision) -> None:
    """ZeRO's combinations with the pipeline engine and with 16-bit training."""
    stage = cfg.zero.stage
    if pp > 1 and stage >= 2:
        raise LayoutError(f"zero.stage={stage} cannot be combined with parallel.pp={pp} "
                          f"(DeepSpeed's pipeline engine refuses it); use zero.stage=1")
    if pp > 1 and stage == 0 and cfg.optimizer.grad_clip > 0:
        # DeepSpeed's clip_grad_norm_ (used without ZeRO) keeps a non-TP parameter's gradient only
        # on the replica's model-parallel rank 0, i.e. the first stage: other stages would be left
        # out of the clipping norm.
        raise LayoutError(f"zero.stage=0 with parallel.pp={pp} would clip gradients by a wrong norm "
                          f"(DeepSpeed counts only the first stage's parameters); use zero.stage=1, "
                          f"which costs the same communication")
    if precision in ("bf16", "fp16") and stage == 0:
        # Accumulating micro-batch gradients in 16 bits loses ~1% of the gradient at 128 micro
        # batches; DeepSpeed keeps fp32 accumulators only in its ZeRO optimizers.
        raise LayoutError(f"train.precision={precision} needs zero.stage >= 1: only DeepSpeed's ZeRO "
                          f"optimizers accumulate gradients in fp32 (data_types.grad_accum_dtype); "
                          f"use zero.stage=1, which costs no extra communication")


def check_context_parallel(plan) -> None:
    """What context parallelism cannot be combined with on this engine."""
    if plan.cp > 1 and plan.engine_plan.zero_stage == 3:
        # DeepSpeed 0.19.8's ZeRO-3 reduce-scatter path (stage3 __avg_scatter_grads) averages gradients over
        # all data x context ranks, where its other paths and ZeRO 0-2 sum over the context ranks: no one
        # loss scale makes both right (measured: the gradient norm 2/3 of one process's at CP2).
        raise LayoutError(f"parallel.cp={plan.cp} cannot be combined with zero.stage=3 under train.engine=deepspeed "
                          f"(DeepSpeed's ZeRO-3 averages the context-parallel gradients inconsistently); use "
                          f"zero.stage 1 or 2, or train.engine=torch (FSDP2 shards over data x context ranks)")
    if plan.cp > 1 and plan.pp > 1:
        # DeepSpeed's pipeline engine builds its own grid and refuses a model-parallel unit, and only an
        # mpu tells ZeRO to partition and reduce over data x context ranks (mpu.ContextParallelMPU).
        raise LayoutError(f"parallel.cp={plan.cp} cannot be combined with parallel.pp={plan.pp} under "
                          f"train.engine=deepspeed (its pipeline engine takes no model-parallel unit, which is how "
                          f"ZeRO learns the context-parallel ranks); set train.engine=torch, or parallel.pp=1")
