"""Weights in the engines' checkpoint formats, for the commands that move them (``megafixed
convert``, ``megafixed import hf``, evaluation): gather any layout into a plain GPT state dict,
shard one into a layout's file set, convert to the re-layout format.

Reading takes either engine's checkpoints (the DeepSpeed engine's files, ``megafixed.engine.
deepspeed.convert``; the torch engine's DCP checkpoints, ``megafixed.engine.native.reader``,
told apart by the files in the tag). What is written is the DeepSpeed engine's module-only
format, which both engines start from (``train.init_from``). Imports no engine library.
"""
from __future__ import annotations

from pathlib import Path

from .deepspeed.convert import (  # noqa: F401  (the format's public functions)
    ConvertError,
    check_target_layout,
    shard_state_dict,
    write_checkpoint,
)
from .deepspeed.convert import detect_layout as _ds_detect_layout
from .deepspeed.convert import gather_state_dict as _ds_gather_state_dict
from .deepspeed.convert import recorded_model_config as _ds_recorded_model_config
from .deepspeed.convert import resolve_tag_dir as _ds_resolve_tag_dir


def _native(tag_dir) -> bool:
    from .native.reader import is_native_checkpoint

    return is_native_checkpoint(tag_dir)


def resolve_tag_dir(ckpt, tag: str | None = None) -> Path:
    """``ckpt`` may be a tag directory (either engine's), or a checkpoint root with a ``latest`` file or ``tag``."""
    root = Path(ckpt)
    if tag is None and root.is_dir() and _native(root):
        return root
    return _ds_resolve_tag_dir(ckpt, tag)


def gather_state_dict(ckpt, tag: str | None = None, verify: bool = True) -> dict:
    """A plain ``GPT`` state dict (full tensors, GPT key names) from a checkpoint of either engine
    and any layout; its files are checked against the manifest first (``verify=False``: the caller did)."""
    tag_dir = resolve_tag_dir(ckpt, tag)
    if _native(tag_dir):
        from .native.reader import read_state_dict

        return read_state_dict(tag_dir, verify=verify)
    return _ds_gather_state_dict(tag_dir, verify=verify)


def _recorded_layout(tag_dir: Path) -> dict:
    from ..run.run_record import read_run_record

    return (read_run_record(tag_dir) or {}).get("layout") or {}


def detect_layout(tag_dir: Path) -> tuple[int, int]:
    """(tp, pp) of a checkpoint: the DeepSpeed engine's from its file names, the torch engine's from
    its run record (its DCP files are one per rank whatever the layout)."""
    if _native(tag_dir):
        lay = _recorded_layout(Path(tag_dir))
        return int(lay.get("tp", 1)), int(lay.get("pp", 1))
    return _ds_detect_layout(tag_dir)


def recorded_model_config(tag_dir: Path) -> dict | None:
    """The ``model`` section the checkpoint's run was trained with, if recorded."""
    if _native(tag_dir):
        from ..run.run_record import read_run_record

        cfg = (read_run_record(Path(tag_dir)) or {}).get("config") or {}
        return cfg.get("model")
    return _ds_recorded_model_config(tag_dir)


def to_relayout_format(tag_dir, model_cfg, out=None, log=print):
    """A checkpoint (weights and optimizer state) that loads on any layout: DeepSpeed's universal
    checkpoint (``megafixed.engine.deepspeed.universal.to_universal``). A torch-engine checkpoint
    needs none: DCP reshards it on load."""
    if _native(tag_dir):
        raise ConvertError(f"{tag_dir} is a torch-engine (train.engine=torch) checkpoint, which already loads on "
                           f"any DP/TP layout with its optimizer state (DCP reshards it on load): rerun "
                           f"`megafixed train` on the new layout; --universal is for DeepSpeed checkpoints")
    from .deepspeed.universal import to_universal

    return to_universal(tag_dir, model_cfg, out=out, log=log)
