"""A trained model + its tokenizer from a run directory or a checkpoint tag directory, through the
one loading path (``megafixed.engine.trained.load_trained_model``: any TP/PP/ZeRO layout)."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..run.run_dir import CHECKPOINTS, LATEST, RUN_RECORD, CheckpointError, RunDirectory


@dataclass
class Loaded:
    model: torch.nn.Module
    cfg: object
    tokenizer: object
    run_dir: str
    tag: str


def _split(path: Path) -> tuple[Path, Optional[str], Optional[tempfile.TemporaryDirectory]]:
    """(run dir, tag, keep-alive temp dir). A run dir has ``checkpoints/``; a tag dir is any folder
    holding DeepSpeed checkpoint files; a folder with a ``latest`` file holds tags (a conversion's
    output). load_trained_model reads ``<run>/checkpoints/<tag>``: a tag outside a run is reached
    through a temporary ``checkpoints`` link to its parent."""
    if RunDirectory(path).checkpoints.is_dir():
        return path, None, None
    is_tag = any(path.glob("*model_states.pt")) or (path / RUN_RECORD).is_file()
    parent, tag = (path.parent, path.name) if is_tag else (path, None)
    if not is_tag and not (path / LATEST).is_file():
        raise CheckpointError(f"{path} is neither a run directory (with checkpoints/) nor a checkpoint "
                              f"(*model_states.pt files); pass a run dir or a checkpoint tag dir")
    if parent.name == CHECKPOINTS:
        return parent.parent, tag, None
    tmp = tempfile.TemporaryDirectory(prefix="megafixed-eval-")
    os.symlink(parent.resolve(), RunDirectory(tmp.name).checkpoints)
    return Path(tmp.name), tag, tmp


def load(path: str | os.PathLike, tag: Optional[str] = None, tokenizer: Optional[str] = None,
         device: Optional[str] = None, dtype: Optional[str] = None) -> Loaded:
    """The model in eval mode on ``device`` (default: cuda if available), bf16 on GPU unless ``dtype``."""
    from ..data.tokenizers import load_tokenizer
    from ..engine.trained import _run_config, load_trained_model
    from ..paths import resolve
    from ..run.run_record import read_run_record

    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist; pass a run directory or a checkpoint directory")
    run_dir, found_tag, tmp = _split(p)
    try:
        model, tag = load_trained_model(None, run_dir, tag or found_tag)
        # the same config load_trained_model used (run record of the tag, else the run's config.yaml)
        cfg = _run_config(run_dir, read_run_record(RunDirectory(run_dir).tag_dir(tag)))
    finally:
        if tmp is not None:
            tmp.cleanup()
    tok_path = tokenizer or resolve(cfg.data.tokenizer)
    if not tok_path:
        raise CheckpointError(f"the config of {p} names no tokenizer (data.tokenizer); pass --tokenizer PATH")
    tok = load_tokenizer(tok_path)
    if tok.eod_id is None:
        raise CheckpointError(f"tokenizer {tok_path} has no end-of-document token, which scoring needs as the "
                              f"empty-context prefix (as lm-eval uses EOS)")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    want = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    model = model.to(dev)
    if want != "float32":
        # the fixed code's buffers keep their dtype: they are codes, not weights
        for t in model.parameters():
            t.data = t.data.to(getattr(torch, want))
        if hasattr(model.input, "out_dtype"):
            model.input.out_dtype = getattr(torch, want)
    model.eval()
    return Loaded(model, cfg, tok, str(p), tag)
