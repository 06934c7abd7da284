"""How ``megafixed plan`` sizes the DeepSpeed engine's layouts (its registry record's ``planner``):
the ZeRO arithmetic of ``megafixed.parallel.memory`` (the model-state bytes per stage 0-3) and its
column of the table. Light: arithmetic only."""
from __future__ import annotations

COLUMN = ("ZeRO", 4)  # the sharding column's title and width


def pp_degrees(gpus: int, tp: int) -> range:
    return range(1, gpus // tp + 1)


def pp_partitions(pp: int) -> tuple:
    # Both balancing rules under PP: with fixed codes, balancing parameters moves blocks onto
    # stage 0, which holds the most in-flight micro batches.
    return ("parameters", "type:Block") if pp > 1 else ("parameters",)


def sharding_options(dp: int) -> tuple:
    return (0, 1, 2, 3)  # each ZeRO stage


def set_sharding(cfg, stage) -> None:
    cfg.zero.stage = stage


def make_layout(cfg, tp, pp, dp, stage, micro, sp, part):
    from ...parallel.memory import Layout

    return Layout(tp, pp, dp, stage, micro, sp, cfg.train.activation_checkpointing, part, cfg.train.engine)


def model_state_bytes(n_params: int, layout, precision: str) -> tuple[float, float, float]:
    """ZeRO-1 divides the optimizer state by DP, ZeRO-2 also the gradients, ZeRO-3 also the
    parameters. 16-bit runs accumulate gradients in fp32 (``data_types.grad_accum_dtype``, which the
    trainer sets, as Megatron's main_grad): a 16-bit gradient per micro batch plus the fp32
    accumulator, 6 bytes per parameter."""
    if precision == "fp32":
        pb, gb, ob = 4, 4, 8
    else:
        pb, gb, ob = 2, 2 + 4, 12
    dp, z = layout.dp, layout.zero
    params = n_params * pb / (dp if z >= 3 else 1)
    grads = n_params * gb / (dp if z >= 2 else 1)
    opt = n_params * ob / (dp if z >= 1 else 1)
    return params, grads, opt


def working_param_bytes(m, layout, n_params: int, precision: str, act_bytes: int) -> float:
    return 0.0  # DeepSpeed computes on the parameters it holds (ZeRO-3 gathers within its budget)


def rank_sharding(layout) -> int:
    return max(layout.zero, 1)  # ZeRO 0 and 1 move the same bytes, so they tie


def sharding_text(layout) -> str:
    return str(layout.zero)


def intro(precision: str):
    return None


def grads_note(precision: str) -> str:
    return " (grads = 16-bit gradients + the fp32 accumulators the trainer uses)" if precision != "fp32" else ""
