"""A trained checkpoint as a plain single-process ``GPT``, whatever layout wrote it: the one loading
path for evaluation, generation, export and ``train.init_from``. It sits beneath both the trainer
(``megafixed.train``) and the evaluation package (``megafixed.eval``), so that each may use the other's
neighbour without the two importing each other."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from torch import nn

from ..run.run_dir import CheckpointError, RunDirectory, read_latest


def trained_state_dict(ckpt_dir: str | os.PathLike, tag: str) -> dict:
    """The full plain-GPT state dict of ``ckpt_dir/tag``, whatever layout wrote it.

    The engine's reader gathers it (``megafixed.engine.weights.gather_state_dict``: TP/PP shards, ZeRO 0-3).
    """
    from ..run.manifest import verify_for_reading
    from . import is_model_file, weights_in_every_rank_file

    tag_dir = Path(ckpt_dir) / tag
    if not tag_dir.is_dir():
        raise CheckpointError(f"{tag_dir} does not exist; pass a tag that is under {ckpt_dir}")
    # Before any tensor is read: ZeRO-3 keeps the weights in every rank's files, others in the model files.
    unverified: list = []
    verify_for_reading(tag_dir, only=None if weights_in_every_rank_file(tag_dir) else is_model_file,
                       warn=unverified.append)
    state = _read_state_dict(tag_dir)
    if unverified:
        from ..run.manifest import warn
        warn(unverified[0])
    return state


def _read_state_dict(tag_dir: Path) -> dict:
    from .base import ConvertError
    from .weights import gather_state_dict

    try:
        return gather_state_dict(tag_dir, verify=False)
    except ConvertError as exc:
        raise CheckpointError(str(exc)) from None


def load_trained_model(cfg, run_dir: str | os.PathLike, tag: Optional[str] = None) -> tuple[nn.Module, str]:
    """A plain single-process ``GPT`` with the weights of ``<run_dir>/checkpoints/<tag or latest>``.

    The one loading path for evaluation, generation and export: it accepts a checkpoint from any
    layout (TP, PP, ZeRO 1-3) and gathers it. ``cfg`` may be None: the checkpoint's own run record
    (or the run's ``config.yaml``) then gives the model config. The fixed code's A/b buffers are
    checked against the config on load (a mismatch raises naming the code fields).
    """
    from ..model import GPT
    from ..run.run_record import read_run_record

    ckpt_dir = RunDirectory(run_dir).checkpoints
    tag = tag or read_latest(ckpt_dir)
    if tag is None:
        raise CheckpointError(f"no checkpoint under {ckpt_dir}; train first (megafixed train ...)")
    if cfg is None:
        cfg = _run_config(run_dir, read_run_record(ckpt_dir / tag))
    state = trained_state_dict(ckpt_dir, tag)
    model = GPT(cfg.model)
    # bf16 runs store bf16 weights; evaluate in fp32. The code buffers keep their dtype for the check.
    weights = {k: v.float() if v.is_floating_point() and not k.split(".")[-1].startswith("code_") else v
               for k, v in state.items()}
    try:
        result = model.load_state_dict(weights, strict=False)
    except RuntimeError as exc:
        raise CheckpointError(f"{ckpt_dir / tag} does not fit this config: {exc}") from None
    problems = [k for k in list(result.missing_keys) + list(result.unexpected_keys)
                if not k.split(".")[-1].startswith("code_")]  # ZeRO-3's reader may drop buffers
    if problems:
        raise CheckpointError(f"{ckpt_dir / tag} does not match model.*: missing/unexpected keys {problems[:8]}")
    return model, tag


def _run_config(run_dir, record):
    from ..config import config_from_dict, load_config

    if record is not None:
        return config_from_dict(record["config"])
    path = RunDirectory(run_dir).config_file
    if not path.exists():
        raise CheckpointError(f"{run_dir} has no config.yaml and its checkpoint no run record; pass the run's "
                              f"config explicitly")
    return load_config(str(path))
