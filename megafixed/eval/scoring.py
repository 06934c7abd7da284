"""Log-likelihoods of continuations, tokenized and truncated as lm-evaluation-harness does it,
computed in as few forward passes as we can.

Tokenization (the harness's ``TemplateLM._encode_pair``): trailing spaces of the context move to
the continuation; ``whole = encode(context + continuation)``, ``ctx = encode(context)``, and the
continuation's tokens are ``whole[len(ctx):]``; an empty context becomes ``[eod]``. The model input
is ``(ctx + cont)[-(max_len + 1):][:-1]`` (left truncation, as ``HFLM._loglikelihood_tokens``).

Speed (why this is not one forward per request, the harness's way):

* a document's requests usually share a long token prefix (HellaSwag's 4 endings share the
  context; MMLU's 4 answer letters share the whole question; Winogrande's two fillings share the
  sentence start). That prefix runs once, into the model's key/value cache
  (``GPT.forward(cache=...)``); the cache is then repeated per request and only the differing
  suffixes run, attending to it. Documents with the same prefix length share one prefill.
* everything else is packed by length (sorted, right-padded: padding after the last real
  position cannot change a causal model's earlier outputs) into batches of ``batch_size`` rows.

The result equals a full forward per request up to float rounding (different matmul shapes);
tests/test_eval_equality.py compares it with the harness through our adapter.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

MIN_SHARED_PREFIX = 4  # below this a prefill costs more (one more forward) than it saves


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
        # the key/value cache seam of GPT.forward; without it every request runs in full
        self.share_prefix = share_prefix and "cache" in inspect.signature(model.forward).parameters
        self.forwards = 0

    @torch.no_grad()
    def score(self, groups: list[list[Request]]) -> list[list[tuple[float, bool]]]:
        from tqdm.auto import tqdm

        self.model.eval()
        out: list[list[Optional[tuple[float, bool]]]] = [[None] * len(g) for g in groups]
        shared: dict[int, list[tuple[int, list[list[int]], list[int]]]] = {}  # prefix len -> docs
        plain: list[tuple[int, int, list[int], int]] = []  # (group, request, input, n_cont)
        for gi, group in enumerate(groups):
            inputs = [_model_input(r, self.max_len) for r in group]
            p = _common_prefix([x for x, _ in inputs]) if self.share_prefix and len(group) > 1 else 0
            if p >= MIN_SHARED_PREFIX:
                shared.setdefault(p, []).append((gi, [x for x, _ in inputs], [c for _, c in inputs]))
            else:
                plain.extend((gi, ri, x, c) for ri, (x, c) in enumerate(inputs))
        total = sum(len(g) for g in groups)
        if self.progress == "lines":  # not a terminal: a line every 30 s (megafixed/progress_lines.py)
            from ..progress_lines import ProgressLines
            bar = ProgressLines(total, desc="scoring", unit="requests")
        else:
            bar = tqdm(total=total, desc="scoring", unit="req", disable=not self.progress, leave=False)
        for p in sorted(shared):
            docs = shared[p]
            i = 0
            while i < len(docs):
                chunk, rows = [], 0
                while i < len(docs) and (not chunk or rows + len(docs[i][1]) <= self.batch_size):
                    chunk.append(docs[i])
                    rows += len(docs[i][1])
                    i += 1
                self._score_shared(p, chunk, out)
                bar.update(rows)
        plain.sort(key=lambda t: -len(t[2]))
        for s in range(0, len(plain), self.batch_size):
            batch = plain[s:s + self.batch_size]
            self._score_plain(batch, out)
            bar.update(len(batch))
        bar.close()
        return out  # type: ignore[return-value]

    def _score_plain(self, batch, out) -> None:
        width = len(batch[0][2])
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for b, (_, _, x, _) in enumerate(batch):
            ids[b, :len(x)] = torch.tensor(x, dtype=torch.long)
        logits = self.model(ids.to(self.device))
        self.forwards += 1
        for b, (gi, ri, x, c) in enumerate(batch):
            n = len(x)
            out[gi][ri] = self._result(logits[b, n - len(c):n], c)

    def _score_shared(self, p: int, chunk, out) -> None:
        from ..model.generate import KVCache

        suffix_len = max(len(x) - p for _, xs, _ in chunk for x in xs)
        prefix = torch.tensor([xs[0][:p] for _, xs, _ in chunk], dtype=torch.long, device=self.device)
        cache = KVCache(len(self.model.blocks), p + suffix_len)
        pre_logits = self.model(prefix, cache=cache)  # [D, p, V]
        owner = [d for d, (_, xs, _) in enumerate(chunk) for _ in xs]
        index = torch.tensor(owner, dtype=torch.long, device=self.device)
        for layer in cache.layers:  # one copy of the prefix's keys/values per request
            layer.k, layer.v = layer.k.index_select(0, index), layer.v.index_select(0, index)
        flat = [(d, ri, x, c) for d, (_, xs, cs) in enumerate(chunk) for ri, (x, c) in enumerate(zip(xs, cs))]
        suffix = torch.zeros(len(flat), suffix_len, dtype=torch.long)
        for r, (_, _, x, _) in enumerate(flat):
            suffix[r, :len(x) - p] = torch.tensor(x[p:], dtype=torch.long)
        suf_logits = self.model(suffix.to(self.device), cache=cache)  # [R, suffix_len, V]
        self.forwards += 2
        for r, (d, ri, x, c) in enumerate(flat):
            n = len(x)
            start = n - len(c)  # first input position whose output predicts a continuation token
            parts = []
            if start < p:
                parts.append(pre_logits[d, start:p])
            parts.append(suf_logits[r, max(start - p, 0):n - p])
            out[chunk[d][0]][ri] = self._result(torch.cat(parts), c)

    @staticmethod
    def _result(logits: torch.Tensor, cont: list[int]) -> tuple[float, bool]:
        """Sum of the continuation's log-probabilities (fp32 log-softmax) and whether greedy
        decoding reproduces it (the harness's ``is_greedy``)."""
        lp = F.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(cont, dtype=torch.long, device=lp.device)
        ll = float(lp.gather(1, target[:, None]).sum())
        return ll, bool((lp.argmax(-1) == target).all())
