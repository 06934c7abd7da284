"""The model, its optimizer and the DeepSpeed engine around them, for one rank of a layout."""
from __future__ import annotations

from ...run.optim import build_optimizer
from ..dtypes import COMPUTE_DTYPES, restore_exact_buffers


def build(cfg, topo, layout, precision: str, hook=None):
    """A ``DeepSpeedEngine`` for this rank of the layout (``layout``: ``parallel.layout.Layout``);
    ``hook``: the ``StepHook`` its step asks (None: none)."""
    import deepspeed

    from ...model import GPT
    from .config import deepspeed_config
    from .context import shard_for_context_parallel
    from .engine import DeepSpeedEngine, hp_grad
    from .grads import TPGradSync
    from .model import build_model
    from .mpu import topology_mpu
    from .muon import skip_muon_import
    from .ops import prepare_ops
    from .pipeline import build_pipeline

    # the config ``DeepSpeedKind.engine_config`` records for the run: for the machine its plan is for
    ds_config = deepspeed_config(cfg, layout, precision, gpu=topo.plan.on_gpu)
    skip_muon_import()  # our optimizer is never Muon: DeepSpeed's checks need not import it (muon.py)
    # Around everything that may start deepspeed.comm (the pipeline grid inside build_model, or initialize).
    with prepare_ops(accelerator_is_cpu=topo.device.type == "cpu"):
        model = build_model(cfg.model, topo, seed=cfg.train.seed, pp_partition=cfg.parallel.pp_partition,
                            activation_checkpointing=cfg.train.activation_checkpointing,
                            compute_dtype=COMPUTE_DTYPES[precision], build_stages=build_pipeline)
        # after TP's layers (the cores sit behind them), before compile (it compiles the wrapped blocks)
        shard_for_context_parallel(model, topo, cfg.data.seq_len)
        if cfg.train.compile:  # a plain GPT here: the run plan refused a pipeline (engine.check_supported)
            for block in model.blocks:
                block.compile()  # in place: parameter names (and so checkpoints) stay unchanged
        optimizer = build_optimizer(model, cfg.optimizer)
        is_pipeline = not isinstance(model, GPT)
        # A PipelineModule carries its own process grid, and DeepSpeed refuses an mpu beside it.
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                               mpu=None if is_pipeline else topology_mpu(topo))
    if precision != "fp32":
        restore_exact_buffers(engine.module)

    step_sync = None
    grad_sync = TPGradSync.for_module(engine.module, topo, grad_of=hp_grad)
    if grad_sync is not None:
        if cfg.zero.stage >= 2:
            grad_sync.install_hooks()  # ZeRO 2/3 reduce inside backward: see engine/deepspeed/grads.py
        elif is_pipeline:
            engine.module.grad_sync = grad_sync  # called at the pipeline's ReduceTiedGrads
        else:
            # Defer DeepSpeed's DP all-reduce of the boundary micro batch; train_step runs the TP
            # sum and then engine.allreduce_gradients() itself (Megatron's finalize_model_grads).
            engine.enable_backward_allreduce = False
            step_sync = grad_sync
    return DeepSpeedEngine(engine, optimizer, cfg=cfg, topo=topo, layout=layout, grad_sync=step_sync, hook=hook)
