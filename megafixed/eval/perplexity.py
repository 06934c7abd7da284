"""Perplexity and bits per byte of a text file or a token-shard prefix.

Each document is scored on its own, as lm-evaluation-harness's ``loglikelihood_rolling`` does it:
``[eod] + tokens`` cut into disjoint windows of ``max_seq_len`` predicted tokens (the harness's
``get_rolling_token_windows(..., context_len=1)``), every token predicted exactly once.

Bits per byte = total negative log-likelihood (nats) / ln 2 / UTF-8 bytes of the text: it does not
depend on the tokenizer, so models with different vocabularies compare. Token perplexity does.
For shards the bytes are those of the decoded tokens (the text the tokenizer reproduces).

The windows are scored by the one held-out scorer (``megafixed.model.heldout``): each window is an
(inputs, targets) pair whose context-only targets are ``IGNORE_INDEX``, packed by length into
right-padded batches (padding after a row's last position cannot change a causal model's earlier
outputs), so every predicted token counts once and weighs the same.
"""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Iterable, Optional

import torch

from ..data.errors import DataError
from ..model.heldout import IGNORE_INDEX, score_heldout
from .scoring import Request


def rolling_requests(tokens: list[int], eod: int, max_len: int) -> list[Request]:
    """Disjoint windows: window j predicts tokens[j*L:(j+1)*L] from the L tokens before them
    (the first from ``[eod]`` plus what fits)."""
    seq = [eod] + list(tokens)
    out = []
    for start in range(0, len(tokens), max_len):
        end = min(start + max_len, len(tokens))
        # inputs seq[s:end] (predicting seq[s+1:end+1] = tokens[s:end]); keep as many as the window holds
        lo = max(0, end - max_len)
        out.append(Request(seq[lo:start + 1], seq[start + 1:end + 1]))
    return out


def read_texts(path: str) -> list[str]:
    """A ``.txt`` file is one document; ``.jsonl``/``.jsonl.gz``: each line's ``"text"``."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"--text {path}: no such file; give a .txt file or a .jsonl(.gz) file with a 'text' field")
    try:
        if p.name.endswith((".jsonl", ".jsonl.gz")):
            opener = gzip.open if p.name.endswith(".gz") else open
            with opener(p, "rt", encoding="utf-8") as fh:
                texts = [json.loads(line)["text"] for line in fh if line.strip()]
        else:
            texts = [p.read_text(encoding="utf-8")]
    except (OSError, EOFError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"--text {path}: cannot read it ({type(exc).__name__}: {exc}); give UTF-8 text or JSON "
                        f"lines with a 'text' field") from None
    texts = [t for t in texts if t]
    if not texts:
        raise DataError(f"--text {path}: holds no text")
    return texts


def shard_documents(prefix: str, max_docs: Optional[int] = None) -> Iterable[list[int]]:
    from ..data.indexed import IndexedShard, shard_exists

    if not shard_exists(prefix):
        raise DataError(f"--prefix {prefix}: no {prefix}.bin/.idx shard; give a prefix written by "
                        f"`megafixed preprocess`")
    shard = IndexedShard(prefix)
    n = shard.num_documents if max_docs is None else min(max_docs, shard.num_documents)
    for i in range(n):
        yield [int(t) for t in shard.document(i)]


def perplexity(model, tok, *, texts: Optional[list[str]] = None, token_docs: Optional[Iterable[list[int]]] = None,
               batch_size: int = 32, progress: bool = True) -> dict:
    """``{"tokens", "bytes", "nll", "perplexity", "bits_per_byte", "documents"}`` (nll in nats)."""
    if texts is not None:
        docs = [(tok.encode(t), len(t.encode("utf-8"))) for t in texts]
    else:
        docs = [(ids, len(tok.decode(ids).encode("utf-8"))) for ids in token_docs]
    docs = [(ids, nbytes) for ids, nbytes in docs if ids]
    if not docs:
        raise DataError("nothing to score: the documents tokenize to no tokens")
    max_len = model.cfg.max_seq_len
    windows = [r for ids, _ in docs for r in rolling_requests(ids, tok.eod_id, max_len)]
    batches = _window_batches(windows, batch_size)
    score = score_heldout(model, _progress(batches, sum(len(b[0]) for b in batches), progress))
    nbytes = sum(b for _, b in docs)
    return {"documents": len(docs), "tokens": score.tokens, "bytes": nbytes, "nll": score.nll,
            "perplexity": score.perplexity, "bits_per_byte": score.nll / math.log(2) / nbytes}


def _window_batches(windows: list[Request], batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) batches of ``batch_size`` windows, longest first; a window predicts its
    continuation from ``context + continuation[:-1]``, and only the continuation is scored."""
    rows = sorted(((r.context + r.continuation[:-1], [IGNORE_INDEX] * (len(r.context) - 1) + r.continuation)
                   for r in windows), key=lambda row: -len(row[0]))
    out = []
    for s in range(0, len(rows), max(1, batch_size)):
        chunk = rows[s:s + max(1, batch_size)]
        width = len(chunk[0][0])
        inputs = torch.zeros(len(chunk), width, dtype=torch.long)
        targets = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
        for b, (x, y) in enumerate(chunk):
            inputs[b, :len(x)] = torch.tensor(x, dtype=torch.long)
            targets[b, :len(y)] = torch.tensor(y, dtype=torch.long)
        out.append((inputs, targets))
    return out


def _progress(batches: list, windows: int, progress):
    """Yield ``batches`` under a bar (``progress=True``), periodic lines (``"lines"``) or nothing."""
    if progress == "lines":  # not a terminal: a line every 30 s (megafixed/progress_lines.py)
        from ..progress_lines import ProgressLines
        bar = ProgressLines(windows, desc="scoring", unit="windows")
    else:
        from tqdm.auto import tqdm
        bar = tqdm(total=windows, desc="scoring", unit="win", disable=not progress, leave=False)
    for batch in batches:
        yield batch
        bar.update(len(batch[0]))
    bar.close()
