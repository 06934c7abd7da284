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
        _check_fused_first_stage(cfg, plan)
    if plan.precision == "fp16":
        # FSDP2 has no dynamic loss scaler (DeepSpeed's fp16 path has one); bf16 needs none.
        raise ConfigError("train.precision=fp16 is not supported by train.engine=torch (it has no loss scaler); "
                          "use train.precision=bf16 (or auto), or train.engine=deepspeed")
    _check_float8(cfg, plan)
    if plan.cp > 1 and plan.cp_method == "ring" and cfg.train.compile:
        # torch's context_parallel swaps SDPA's dispatch for the ring inside the step; compiled blocks trace
        # that dispatch, and no GPU check has run the two together yet (torchtitan reports breaks there).
        raise ConfigError("parallel.cp_method=ring with train.compile=true is not supported yet (no GPU check "
                          "has run ring attention in compiled blocks); set train.compile=false, or use "
                          "parallel.cp_method=ulysses")
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


def _check_fused_first_stage(cfg, plan) -> None:
    """The fused first layer runs in block 0 from the ids, so block 0 must be on the input's stage: a
    first stage holding the input alone has to send the code itself to the next one."""
    from .schedules import stage_spans

    if not getattr(cfg.model, "fused_first_layer", False):
        return
    own = plan.engine_plan
    first = stage_spans(cfg.model.n_layers, plan.pp * own.vpp, own.pp_input_head_layers)[0]
    if not first.blocks:
        raise LayoutError(f"model.fused_first_layer=true computes block 0 from the token ids, but the first "
                          f"pipeline stage holds the input alone (model.n_layers={cfg.model.n_layers} over "
                          f"{plan.pp * own.vpp} stages, parallel.pp_input_head_layers={own.pp_input_head_layers}); "
                          f"lower parallel.pp_input_head_layers or parallel.vpp, or set model.fused_first_layer=false")


def _check_float8(cfg, plan) -> None:
    """train.float8 (float8.py): what is not wired or cannot run, by name."""
    recipe = cfg.train.float8
    if recipe == "off":
        return
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"train.float8={recipe} needs torchao: pip install 'torchao>=0.18,<0.19' "
                          f"(megafixed's [float8] extra), or set train.float8=off")
    # Tensor parallelism composes through the TP plan's ordinary DTensor styles over Float8Linear (torchtitan's
    # way for rowwise): the scales come from the DTensors, so a TP=2 run gives one process's losses (tested).
    # torchao's Float8ColwiseParallel/Float8RowwiseParallel, which also send tensorwise activations in float8,
    # are not applied: a saving of TP communication on CUDA, which nothing here could run.
    # train.compile=true composes (each block's Float8Linear compiled in place): on CPU, emulated, a
    # compiled block's forward and backward gave eager's loss bit for bit (docs/float8.md).
