"""Held-out test loss and bits per byte of a trained run (what the study compares)."""
from __future__ import annotations

import math

import torch


@torch.no_grad()
def heldout_metrics(cfg, run_dir, max_windows: int = 256, batch: int = 8) -> dict:
    """Mean next-token loss on the run's *test* split (its first ``max_windows`` windows, in batches
    of ``batch``; scored by ``megafixed.model.heldout``) and bits per byte of the same text.

    Bits per byte = total NLL (nats) / (ln 2 x UTF-8 bytes of the decoded target tokens): unlike the
    loss per token it does not depend on the tokenizer, so runs with other vocabularies compare.
    End-of-document tokens count in the NLL and add no bytes (they stand for no text).
    """
    from ..config import load_config
    from ..data.gpt_dataset import build_datasets
    from ..data.tokenizers import load_tokenizer
    from ..model.heldout import score_heldout
    from ..run.run_dir import RunDirectory
    from ..train.evaluate import load_trained_model

    run_cfg = load_config(str(RunDirectory(run_dir).config_file))  # resolved paths, as the run trained
    model, _ = load_trained_model(run_cfg, run_dir)
    test = build_datasets(run_cfg.data, seed=run_cfg.train.seed).get("test")
    if test is None or len(test) == 0:
        return {"test_loss": math.nan, "test_bpb": math.nan, "test_tokens": 0}
    tok = load_tokenizer(run_cfg.data.tokenizer) if run_cfg.data.tokenizer else None
    n = min(len(test), max_windows)
    windows = [torch.stack([torch.as_tensor(test[i].astype("int64")) for i in range(start, min(n, start + batch))])
               for start in range(0, n, batch)]
    score = score_heldout(model, windows)
    n_bytes = 0
    if tok is not None:
        for w in windows:
            for row in w[:, 1:].tolist():
                n_bytes += len(tok.decode([t for t in row if t != tok.eod_id]).encode("utf-8"))
    return {"test_loss": score.loss, "test_bpb": score.nll / (math.log(2) * n_bytes) if n_bytes else math.nan,
            "test_tokens": score.tokens}
