"""Tree-packed forward passes for log-likelihood scoring: a document's shared prefix once, its
continuations after it in the same row, several documents per row, no key/value cache.

Why (profiled on SmolLM2-135M, docs/benchmarks.md): the forward's matmuls are ~all the time, so
what counts is how many positions run through the body and the LM head. The earlier scorer shared
a prefix through a KV cache, but only among documents of the *same* prefix length, and padded each
chunk's suffixes to the longest: on HellaSwag+PIQA+LAMBADA it ran more positions than lm-eval's
plain length-sorted batches, and computed the 49k-vocabulary head at every one of them. Here:

* a row holds whole documents as trees: ``[prefix][suffix 1][suffix 2]...``; each suffix's RoPE
  positions continue from the prefix, and the attention mask lets a token see earlier tokens of its
  own branch and its document's prefix, nothing else. Rows are filled first-fit decreasing, so the
  only padding is a row's tail, and a forward's positions are about the documents' unique tokens;
* the head (final norm + vocabulary projection) runs only at positions whose output predicts a
  scored continuation token (about a third of the positions on these tasks).

Each kept position computes what a plain causal forward of its own request computes (same keys,
same positions); only matmul shapes differ, hence float rounding. The rows run through the model's
own forward (``GPT.forward`` with ``positions`` and ``attn_mask``), so eval runs training's model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class Tree:
    """One document's requests: the shared ``prefix`` and, per request, its suffix and what it scores."""

    slot: int  # the group index
    prefix: list[int]
    suffixes: list[list[int]] = field(default_factory=list)
    scored: list[tuple[int, list[int]]] = field(default_factory=list)  # (first scored input index, cont ids)

    @property
    def size(self) -> int:
        return len(self.prefix) + sum(len(s) for s in self.suffixes)


@dataclass
class Row:
    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    doc: list[int] = field(default_factory=list)  # tree number within the row; -1 for padding
    branch: list[int] = field(default_factory=list)  # 0: the prefix; k: the k-th suffix
    # (group, request, locations in the row whose outputs predict the continuation, cont ids)
    targets: list[tuple[int, int, list[int], list[int]]] = field(default_factory=list)

    def add(self, tree: Tree) -> None:
        d, p, start = len(set(self.doc) - {-1}), len(tree.prefix), len(self.ids)
        self._extend(tree.prefix, range(p), d, 0)
        for k, (suffix, (first, cont)) in enumerate(zip(tree.suffixes, tree.scored)):
            off = len(self.ids)
            self._extend(suffix, range(p, p + len(suffix)), d, k + 1)
            # input index t sits in the prefix (t < p: a continuation's first tokens shared by all
            # requests) or in this request's suffix
            where = [start + t if t < p else off + t - p for t in range(first, first + len(cont))]
            self.targets.append((tree.slot, k, where, cont))

    def _extend(self, ids, positions, d: int, branch: int) -> None:
        self.ids += ids
        self.pos += positions
        self.doc += [d] * len(ids)
        self.branch += [branch] * len(ids)


def make_tree(slot: int, inputs: list[tuple[list[int], list[int]]], prefix_len: int) -> Tree:
    """``inputs``: each request's (model input, continuation ids); the first ``prefix_len`` input
    tokens are common to all of them."""
    tree = Tree(slot, inputs[0][0][:prefix_len])
    for x, cont in inputs:
        tree.suffixes.append(x[prefix_len:])
        tree.scored.append((len(x) - len(cont), cont))
    return tree


def pack(trees: list[Tree], capacity: int) -> list[Row]:
    """First-fit decreasing into rows of at most ``capacity`` positions (a bigger tree gets its own)."""
    rows: list[Row] = []
    for tree in sorted(trees, key=lambda t: -t.size):
        for row in rows:
            if len(row.ids) + tree.size <= capacity:
                row.add(tree)
                break
        else:
            rows.append(Row())
            rows[-1].add(tree)
    return rows


def _tensors(rows: list[Row], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, T], positions [B, T], attention mask [B, 1, T, T], True = may attend)."""
    width = max(len(r.ids) for r in rows)

    def padded(name, fill):
        return torch.tensor([getattr(r, name) + [fill] * (width - len(r.ids)) for r in rows], dtype=torch.long)

    ids, pos, doc, branch = padded("ids", 0), padded("pos", 0), padded("doc", -1), padded("branch", 0)
    same_doc = doc[:, :, None] == doc[:, None, :]
    visible = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = same_doc & visible & causal  # padding (doc -1) sees earlier padding: never empty, never read
    return ids.to(device), pos.to(device), mask[:, None].to(device)


def score_rows(model, rows: list[Row], device) -> list[tuple[int, int, float, bool]]:
    """One forward over ``rows``: (group, request, log-likelihood, is_greedy) per request. The head
    runs only at the scored locations; log-softmax in fp32 as the harness does."""
    ids, pos, mask = _tensors(rows, device)
    h = model(ids, positions=pos, attn_mask=mask, head=False)  # the last block's output, before the head
    flat, spans, targets = [], [], []
    for b, row in enumerate(rows):
        for gi, ri, where, cont in row.targets:
            spans.append((gi, ri, len(flat), len(where)))
            flat += [b * ids.shape[1] + w for w in where]
            targets += cont
    picked = h.reshape(-1, h.shape[-1]).index_select(0, torch.tensor(flat, dtype=torch.long, device=device))
    lp = F.log_softmax(model.head(picked).float(), dim=-1)
    target = torch.tensor(targets, dtype=torch.long, device=device)
    token_lp = lp.gather(1, target[:, None])[:, 0]
    greedy = (lp.argmax(-1) == target).tolist()
    # fp32 sums per request, as the harness sums its gathered log-probabilities
    return [(gi, ri, float(token_lp[s:s + n].sum()), all(greedy[s:s + n])) for gi, ri, s, n in spans]
