"""The model, its optimizer and the DeepSpeed engine around them, for one rank of a layout."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .optim import build_optimizer

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class EngineBundle:
    engine: object  # deepspeed.DeepSpeedEngine or PipelineEngine
    optimizer: torch.optim.Optimizer
    grad_sync: Optional[object]  # TPGradSync the step must finish at the boundary (plain engine, SP, ZeRO 0/1)

    @property
    def is_pipeline(self) -> bool:
        from .step import is_pipeline_engine
        return is_pipeline_engine(self.engine)


def restore_exact_buffers(module) -> None:
    """Rewrite buffers that must stay exact after DeepSpeed casts the module to bf16/fp16 (the
    fixed code's scale). RoPE tables need nothing: they are an fp32 cache, not buffers."""
    for sub in module.modules():
        if hasattr(sub, "reset_buffers"):
            sub.reset_buffers()


def build_engine(cfg, topo, ds_config: dict, precision: str) -> EngineBundle:
    import deepspeed

    from ..model import GPT
    from ..parallel import build_model
    from ..parallel.grads import TPGradSync
    from .ds_ops import prepare_ops

    # Before anything starts deepspeed.comm (the pipeline grid inside build_model, or initialize).
    prepare_ops(topo.world_size, topo.local_rank, accelerator_is_cpu=topo.device.type == "cpu")
    model = build_model(cfg.model, topo, seed=cfg.train.seed, pp_partition=cfg.parallel.pp_partition,
                        activation_checkpointing=cfg.train.activation_checkpointing,
                        compute_dtype=COMPUTE_DTYPES[precision])
    if cfg.train.compile and isinstance(model, GPT):
        for block in model.blocks:
            block.compile()  # in place: parameter names (and so checkpoints) stay unchanged
    optimizer = build_optimizer(model, cfg.optimizer)
    is_pipeline = not isinstance(model, GPT)
    # A PipelineModule carries its own process grid, and DeepSpeed refuses an mpu beside it.
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                           mpu=None if is_pipeline else topo.mpu)
    if precision != "fp32":
        restore_exact_buffers(engine.module)

    step_sync = None
    grad_sync = TPGradSync.for_module(engine.module, topo)
    if grad_sync is not None:
        if cfg.zero.stage >= 2:
            grad_sync.install_hooks()  # ZeRO 2/3 reduce inside backward: see parallel/grads.py
        elif is_pipeline:
            engine.module.grad_sync = grad_sync  # called at the pipeline's ReduceTiedGrads
        else:
            # Defer DeepSpeed's DP all-reduce of the boundary micro batch; train_step runs the TP
            # sum and then engine.allreduce_gradients() itself (Megatron's finalize_model_grads).
            engine.enable_backward_allreduce = False
            step_sync = grad_sync
    return EngineBundle(engine=engine, optimizer=optimizer, grad_sync=step_sync)
