"""Held-out loss / perplexity of a plain model over a dataset split, and loading a trained model.

Reusable outside the trainer: ``megafixed quickstart`` calls these on the final checkpoint, and
later evaluation work can call them on any GPT built from a config (generation: ``model.generate``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..run.run_dir import CheckpointError, RunDirectory, read_latest


@dataclass
class EvalResult:
    loss: float  # mean next-token cross entropy (nats)
    perplexity: float
    tokens: int  # target tokens scored (all ranks)
    batches: int  # micro batches per rank


@torch.no_grad()
def evaluate_loss(cfg, model: nn.Module, dataset, *, micro_batch: Optional[int] = None,
                  max_batches: Optional[int] = None, dp_rank: int = 0, dp_size: int = 1, dp_group=None,
                  device: Optional[torch.device] = None) -> EvalResult:
    """Mean loss of ``model`` (a GPT, called as ``model(inputs, targets)``) over a dataset split.

    Walks the split from its first sample, each DP rank taking its share, for at most
    ``max_batches`` micro batches per rank (None: the whole split, whole micro batches only).
    """
    from ..data.gpt_dataset import micro_batches

    if dataset is None:
        raise ValueError("this data split is empty; give it a share in data.split (e.g. '98,1,1')")
    mb = micro_batch or cfg.train.micro_batch
    available = len(dataset) // (mb * dp_size)
    n = available if max_batches is None else min(max_batches, available)
    if n < 1:
        raise ValueError(f"the split has {len(dataset)} samples, fewer than one micro batch of {mb} per rank "
                         f"x {dp_size} ranks; lower train.micro_batch or give the split a larger data.split share")
    from itertools import islice

    from ..model.heldout import score_heldout

    it = micro_batches(dataset, start_sample=0, micro_batch=mb, dp_rank=dp_rank, dp_size=dp_size)
    score = score_heldout(model, islice(it, n), dp_size=dp_size, dp_group=dp_group, device=device)
    return EvalResult(loss=score.loss, perplexity=score.perplexity, tokens=score.tokens, batches=n)


def trained_state_dict(ckpt_dir: str | os.PathLike, tag: str) -> dict:
    """The full plain-GPT state dict of ``ckpt_dir/tag``, whatever layout wrote it.

    The engine's reader gathers it (``megafixed.engine.weights.gather_state_dict``: TP/PP shards, ZeRO 0-3).
    """
    from ..engine import is_model_file, weights_in_every_rank_file
    from ..run.manifest import verify_for_reading

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
    from ..engine import ConvertError
    from ..engine.weights import gather_state_dict

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
