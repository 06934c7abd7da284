"""Weights in the engines' checkpoint formats, for the commands that move them (``megafixed
convert``, ``megafixed import hf``, evaluation, ``train.init_from``): gather any layout into a plain
GPT state dict (``gather_state_dict``, the one reader), shard one into a layout's file set, convert
to the re-layout format.

Reading takes any registered engine's checkpoints: the engine whose checkpoint detector claims the
tag reads it (``megafixed.engines.checkpoint_kind``; the DeepSpeed engine's files are the default
format). What is written is the DeepSpeed engine's module-only format, which every engine starts
from (``train.init_from``). Imports no engine library.
"""
from __future__ import annotations

from pathlib import Path

from ..engines import checkpoint_kind
from .deepspeed.convert import (  # noqa: F401  (the written format's public functions)
    ConvertError,
    check_target_layout,
    shard_state_dict,
    write_checkpoint,
)
from .deepspeed.convert import resolve_tag_dir as default_resolve_tag_dir
from .protocols import CheckpointFormat


def _format(tag_dir) -> CheckpointFormat:
    return checkpoint_kind(Path(tag_dir)).checkpoint


def resolve_tag_dir(ckpt, tag: str | None = None) -> Path:
    """``ckpt`` may be a tag directory (any engine's), or a checkpoint root with a ``latest`` file or ``tag``."""
    root = Path(ckpt)
    if tag is None and root.is_dir() and not checkpoint_kind(root).facts.default:
        return root  # a tag directory another engine's marker file claims
    return default_resolve_tag_dir(ckpt, tag)  # the default format's: its tag folder, ``latest`` or ``tag``


def gather_state_dict(ckpt, tag: str | None = None, verify: bool = True) -> dict:
    """A plain ``GPT`` state dict (full tensors, GPT key names) from a checkpoint of any engine and
    any layout (TP, PP, ZeRO 0-3, DCP); the files it reads are checked against the manifest first
    (``verify=False``: the caller did)."""
    tag_dir = resolve_tag_dir(ckpt, tag)
    return _format(tag_dir).read_state_dict(tag_dir, verify=verify)


def detect_layout(tag_dir: Path) -> tuple[int, int]:
    """(tp, pp) of a checkpoint: the DeepSpeed engine's from its file names, the torch engine's from
    its run record (its DCP files are one per rank whatever the layout)."""
    return _format(tag_dir).detect_layout(tag_dir)


def recorded_model_config(tag_dir: Path) -> dict | None:
    """The ``model`` section the checkpoint's run was trained with, if recorded."""
    return _format(tag_dir).recorded_model_config(tag_dir)


def to_relayout_format(tag_dir, model_cfg, out=None, log=print):
    """A checkpoint (weights and optimizer state) that loads on any layout: DeepSpeed's universal
    checkpoint (``megafixed.engine.deepspeed.universal.to_universal``); an engine that reshards on
    load (the torch engine: DCP) refuses, naming what to do instead."""
    return _format(tag_dir).to_relayout_format(tag_dir, model_cfg, out=out, log=log)
