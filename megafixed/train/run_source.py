"""A trained model named by a path: the run directory, tag, config and tokenizer behind it (in
train/, beneath interop/: ``train.init_from`` and the interop verbs both read runs through it).

Verbs that read a trained model (``export``, ``generate``) accept a run directory, its
``checkpoints`` folder or one tag directory under it; the weights are always loaded through the
one loading path, ``megafixed.train.evaluate.load_trained_model`` (any TP/PP/ZeRO layout).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..run.run_dir import CHECKPOINTS, RunDirectory
from .checkpoint import CheckpointError, tag_step


@dataclass
class RunSource:
    run_dir: Path
    tag: str
    config: object  # megafixed.config.Config the checkpoint was trained with
    record: Optional[dict]  # the tag's run.json (config + layout), if written

    @property
    def tag_dir(self) -> Path:
        return RunDirectory(self.run_dir).tag_dir(self.tag)

    @property
    def step(self) -> Optional[int]:
        s = tag_step(self.tag)
        return s if s >= 0 else None

    def load_model(self):
        """The plain fp32 ``GPT`` of this checkpoint (gathered from any layout), in eval mode."""
        import copy

        from ..train.evaluate import load_trained_model

        cfg = copy.deepcopy(self.config)
        if getattr(cfg.model, "fused_first_layer", False):
            # Same parameters, plain path: generation's key/value cache and the export mapping
            # follow the readable blocks (the fused path is a training-speed option).
            cfg.model.fused_first_layer = False
        model, _ = load_trained_model(cfg, self.run_dir, self.tag)
        return model.eval()


def resolve_run(path: str | os.PathLike, tag: Optional[str] = None) -> RunSource:
    """``path`` is a run directory (with ``checkpoints/``), its ``checkpoints`` folder, or a tag
    directory ``<run>/checkpoints/<tag>``; ``tag`` picks another tag (default: ``latest``)."""
    from .evaluate import _run_config
    from .resume import read_run_record

    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} not found; pass a run directory (the train.run_dir of a run), its "
                              f"checkpoints folder, or one of its tag directories")
    if RunDirectory(p).checkpoints.is_dir():
        run_dir = p
    elif p.name == CHECKPOINTS and p.is_dir():
        run_dir = p.parent
    elif p.parent.name == CHECKPOINTS and p.is_dir():
        run_dir, tag = p.parent.parent, tag or p.name
    else:
        raise CheckpointError(f"{p} is not a megafixed run: expected a run directory holding checkpoints/ "
                              f"(train.run_dir), its checkpoints folder or a tag directory under it. A "
                              f"`megafixed convert` output has no config: convert back with --tp 1 --pp 1 "
                              f"into <run>/checkpoints or use the original run")
    rd = RunDirectory(run_dir)
    ckpt_dir = rd.checkpoints
    tag = tag or rd.read_latest()
    if tag is None:
        raise CheckpointError(f"no checkpoint under {ckpt_dir} (no 'latest' file); train first or pass --tag")
    if not (ckpt_dir / tag).is_dir():
        raise CheckpointError(f"{ckpt_dir / tag} does not exist; tags there: "
                              f"{', '.join(sorted(d.name for d in ckpt_dir.iterdir() if d.is_dir())) or 'none'}")
    record = read_run_record(ckpt_dir / tag)
    return RunSource(run_dir=run_dir, tag=tag, config=_run_config(run_dir, record), record=record)


def run_tokenizer(cfg, override: Optional[str] = None):
    """The tokenizer a run was trained with: ``override``, ``data.tokenizer``, or the one its first
    shard's ``.meta.json`` records. None when nothing names one."""
    from ..data.tokenizers import load_tokenizer

    if override:
        return load_tokenizer(override)
    if cfg.data.tokenizer:
        return load_tokenizer(cfg.data.tokenizer)
    if cfg.data.prefixes:
        import json

        from ..data.indexed import meta_path
        from ..data.prefixes import resolve_prefix
        try:
            first = resolve_prefix(cfg.data.prefixes[0])[0]
            with open(meta_path(first)) as fh:
                spec = json.load(fh).get("tokenizer")
        except (OSError, ValueError):
            spec = None
        if spec:
            return load_tokenizer(spec)
    return None
