"""Weights in the engine's checkpoint format, for the commands that move them (``megafixed
convert``, ``megafixed import hf``, evaluation): gather any layout into a plain GPT state dict,
shard one into a layout's file set, convert to the re-layout format. Today the DeepSpeed engine's
format (``megafixed.engine.deepspeed.convert`` / ``universal``); imports no engine library."""
from __future__ import annotations

from .deepspeed.convert import (  # noqa: F401  (the format's public functions)
    ConvertError,
    check_target_layout,
    detect_layout,
    gather_state_dict,
    recorded_model_config,
    resolve_tag_dir,
    shard_state_dict,
    write_checkpoint,
)


def to_relayout_format(tag_dir, model_cfg, out=None, log=print):
    """A checkpoint (weights and optimizer state) that loads on any layout: DeepSpeed's universal
    checkpoint (``megafixed.engine.deepspeed.universal.to_universal``)."""
    from .deepspeed.universal import to_universal

    return to_universal(tag_dir, model_cfg, out=out, log=log)
