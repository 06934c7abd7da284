"""What the torch engine refuses by name, checked by the run plan before any process group (and on
a login node for ``--dry-run``); imports nothing heavy."""
from __future__ import annotations

from ...config import ConfigError
from ...parallel.layout import LayoutError


def check_supported(cfg, plan) -> None:
    from ...config_checks import check_pipeline_keys_need_pp

    check_pipeline_keys_need_pp(cfg, plan.pp)
    if plan.pp > 1:  # torch.distributed.pipelining: the schedule's constraints, by name (schedules.py)
        from .schedules import check_pipeline

        check_pipeline(cfg, plan)
    if plan.precision == "fp16":
        # FSDP2 has no dynamic loss scaler (DeepSpeed's fp16 path has one); bf16 needs none.
        raise ConfigError("train.precision=fp16 is not supported by train.engine=torch (it has no loss scaler); "
                          "use train.precision=bf16 (or auto), or train.engine=deepspeed")
    replicate = cfg.torch_engine.dp_replicate
    if plan.dp % replicate:
        raise LayoutError(f"torch_engine.dp_replicate={replicate} does not divide the data-parallel size "
                          f"{plan.dp}; HSDP needs dp = dp_replicate * dp_shard: use a divisor of {plan.dp} "
                          f"(1: shard over every data-parallel rank; {plan.dp}: replicate, no sharding)")
    if cfg.zero.offload_optimizer:
        # A DeepSpeed key; FSDP2's CPUOffloadPolicy is not wired in, and ignoring the key would let a run
        # that counts on the offload run out of device memory.
        raise ConfigError("zero.offload_optimizer=true is a DeepSpeed option; train.engine=torch does not offload "
                          "the optimizer: set zero.offload_optimizer=false, or train.engine=deepspeed")
    if getattr(cfg.model, "fused_first_layer", False) and plan.dp > 1:
        # The fused kernel reads the first block's full q/k/v weights from GPT.forward; under FSDP2
        # they are shards there (the block's all-gather runs in its own pre-forward hook).
        raise ConfigError(f"model.fused_first_layer=true is implemented for one data-parallel rank under "
                          f"train.engine=torch (it reads the first block's full weights, which FSDP2 keeps "
                          f"sharded over dp={plan.dp}); set model.fused_first_layer=false, or "
                          f"train.engine=deepspeed")
