"""The tensor-parallel *plan*, engine-neutral: which Linear of the GPT is column- or row-parallel
(``TP_PLAN``/``HEAD_PLAN``/``linear_plan``), which parameter is sharded along which dim
(``sharded_dim``: our converter, DeepSpeed's universal checkpoint and the planner read it), which
are the vocabulary rows, and keeping only a rank's positions under sequence parallelism. Both
engines apply the one plan: the DeepSpeed engine with megatron-core's layers
(``megafixed.engine.deepspeed.tp_layers.apply_tp``), the torch engine with DTensor
(``megafixed.engine.native.tensor.apply_tp``). No megatron-core here: it is imported only under
``megafixed/engine/``.
"""
from __future__ import annotations

from torch import nn

from ..model.gpt import GPT
from ..model.interfaces import sharded_parameters, vocab_parameters

# Which Linear is split how (Megatron's scheme): column-parallel layers shard their output
# features (dim 0 of the weight), row-parallel ones their input features (dim 1).
# ONE plan, two appliers: megatron-core's layers (engine/deepspeed/tp_layers.py, the DeepSpeed engine) and
# ``megafixed.engine.native.tensor``'s DTensor Colwise/RowwiseParallel (the torch engine) both
# read ``linear_plan``; ``sharded_dim`` (checkpoint slicing) reads the same tables.
TP_PLAN = {"attn.wq": "column", "attn.wk": "column", "attn.wv": "column", "attn.wo": "row",
           "mlp.w_in": "column", "mlp.w_gate": "column", "mlp.w_out": "row"}
# The output head: column-parallel over the vocabulary, its logits stay split (vocab-parallel loss).
HEAD_PLAN = {"head.proj": "column"}


def linear_plan(model: GPT) -> dict[str, str]:
    """``{module path in model: "column" | "row"}`` of every Linear tensor parallelism splits:
    ``TP_PLAN`` in each block (only the Linears the block has: ``w_gate`` is SwiGLU's) and the head.
    The input is not here: its TP form is its interface's (``tp_form``)."""
    plan = {}
    for i, block in enumerate(model.blocks):
        for name, kind in TP_PLAN.items():
            owner, attr = name.split(".")
            if getattr(getattr(block, owner), attr, None) is not None:
                plan[f"blocks.{i}.{name}"] = kind
    plan.update(HEAD_PLAN)
    return plan


def keep_local_positions(module: nn.Module, tp: int, tp_rank: int) -> None:
    """Sequence parallelism for a replicated input (fixed codes): ``module`` computes only this
    rank's ``[B, T/tp, D]`` slice of positions, from the token ids, with no table and no
    communication. A forward pre-hook (torchtitan's ``PrepareModuleInput`` idea) rather than a
    wrapper, so the module keeps its class, its buffers' names and its state-dict keys."""
    def local_ids(_module, args):
        ids, *rest = args
        local = ids.shape[1] // tp
        return (ids[:, tp_rank * local:(tp_rank + 1) * local], *rest)
    module.register_forward_pre_hook(local_ids)


def sharded_dim(name: str) -> int | None:
    """Which dim of the plain-GPT parameter ``name`` is split under TP (None: replicated)."""
    for key, dim in sharded_parameters().items():  # the interfaces' own (a split table's vocab rows)
        if name.endswith(key):
            return dim
    for key, kind in {**TP_PLAN, **HEAD_PLAN}.items():
        if name.endswith(f"{key}.weight"):
            return 0 if kind == "column" else 1
        if name.endswith(f"{key}.bias"):
            return 0 if kind == "column" else None
    return None


def is_vocab_parameter(name: str) -> bool:
    """One row per token id (the output head, an input table): DeepSpeed's universal checkpoint
    pads and slices these by the vocabulary size."""
    return name.endswith(("head.proj.weight", *vocab_parameters()))
