"""Log-likelihoods of continuations, tokenized and truncated as lm-evaluation-harness does it,
computed in as few forward passes as we can.

Tokenization (the harness's ``TemplateLM._encode_pair``): trailing spaces of the context move to
the continuation; ``whole = encode(context + continuation)``, ``ctx = encode(context)``, and the
continuation's tokens are ``whole[len(ctx):]``; an empty context becomes ``[eod]``. The model input
is ``(ctx + cont)[-(max_len + 1):][:-1]`` (left truncation, as ``HFLM._loglikelihood_tokens``).

Speed (why this is not one forward per request, the harness's way): a document's requests usually
share a long token prefix (HellaSwag's 4 endings share the context; MMLU's 4 answer letters share
the whole question; Winogrande's two fillings share the sentence start). Each document becomes a
tree, the prefix once and each request's differing suffix after it, and trees are packed into rows
(``megafixed.eval.packed``: per-token positions and a mask, no padding between documents); the
LM head runs only where a continuation token is scored.

The result equals a full forward per request up to float rounding (different matmul shapes);
tests/test_eval_equality.py compares it with the harness through our adapter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

ATTENTION_BYTES = 1 << 30  # per forward, per layer: bounds memory on long (few-shot) documents


@dataclass
class Request:
    context: list[int]
    continuation: list[int]


def encode_pair(tok, context: str, continuation: str, cache: Optional[dict] = None) -> Request:
    """The harness's split of ``context + continuation`` into token lists (see module doc)."""
    if context == "":
        cont = tok.encode(continuation)
        eod = tok.eod_id
        return Request([eod], cont) if not cont or cont[0] != eod else Request(cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok.encode(context + continuation)
    if cache is not None:
        if context not in cache:
            cache[context] = tok.encode(context)
        ctx = cache[context]
    else:
        ctx = tok.encode(context)
    return Request(ctx, whole[len(ctx):])


def _model_input(req: Request, max_len: int) -> tuple[list[int], list[int]]:
    """(input ids, continuation ids), the input truncated on the left like the harness's."""
    full = req.context + req.continuation
    # A continuation longer than the model's context (a small model, a long PIQA answer): only its
    # last max_len tokens can be scored. The harness's HFLM fails on such requests; our adapter
    # does the same as this, so the two stay comparable.
    return full[-(max_len + 1):][:-1], req.continuation[-max_len:]


def _common_prefix(rows: Sequence[Sequence[int]]) -> int:
    n = min(len(r) for r in rows) - 1  # every row keeps at least one position of its own
    first = rows[0]
    for i in range(max(n, 0)):
        if any(r[i] != first[i] for r in rows[1:]):
            return i
    return max(n, 0)


class Scorer:
    """``score(groups)``: for each group (a document's requests), ``[(loglikelihood, is_greedy)]``."""

    def __init__(self, model, batch_size: int = 32, device: Optional[torch.device] = None,
                 progress: bool | str = True, share_prefix: bool = True):  # "lines": ProgressLines
        self.model = model
        self.device = device or next(model.parameters()).device
        self.batch_size = max(1, int(batch_size))
        self.max_len = model.cfg.max_seq_len
        self.progress = progress
        self.share_prefix = share_prefix  # False: every request runs in full (a check, not a speed-up)
        self.forwards = 0

    def batches(self, groups: list[list[Request]]) -> list[list]:
        """The forward passes that score ``groups``: lists of packed rows (``packed.Row``), widest
        first. Each request is in exactly one row; the same groups give the same batches on every
        process, which lets data-parallel ranks split them (``megafixed.eval.in_loop``)."""
        from .packed import make_tree, pack

        trees = []
        for gi, group in enumerate(groups):
            inputs = [_model_input(r, self.max_len) for r in group]
            p = _common_prefix([x for x, _ in inputs]) if self.share_prefix and len(group) > 1 else 0
            trees.append(make_tree(gi, inputs, p))
        # rows as wide as the largest document: first-fit decreasing leaves little padding
        rows = pack(trees, max((t.size for t in trees), default=1))
        rows.sort(key=lambda r: -len(r.ids))  # a forward's rows are of similar width
        out, s = [], 0
        while s < len(rows):
            # the attention scores of a row are heads x width^2 floats (the mask is not causal-only, so
            # SDPA may take its math path): fewer rows per forward for wide ones (few-shot prompts)
            width = len(rows[s].ids)
            n = max(1, min(self.batch_size, ATTENTION_BYTES // (4 * self.model.cfg.n_heads * width * width)))
            out.append(rows[s:s + n])
            s += n
        return out

    @torch.inference_mode()
    def score(self, groups: list[list[Request]]) -> list[list[tuple[float, bool]]]:
        from tqdm.auto import tqdm

        from .packed import score_rows

        self.model.eval()
        out: list[list[Optional[tuple[float, bool]]]] = [[None] * len(g) for g in groups]
        total = sum(len(g) for g in groups)
        if self.progress == "lines":  # not a terminal: a line every 30 s (megafixed/progress_lines.py)
            from ..progress_lines import ProgressLines
            bar = ProgressLines(total, desc="scoring", unit="requests")
        else:
            bar = tqdm(total=total, desc="scoring", unit="req", disable=not self.progress, leave=False)
        for batch in self.batches(groups):
            for gi, ri, ll, greedy in score_rows(self.model, batch, self.device):
                out[gi][ri] = (ll, greedy)
            self.forwards += 1
            bar.update(sum(len(r.targets) for r in batch))
        bar.close()
        return out  # type: ignore[return-value]
