"""Sampling from a plain ``GPT`` with a key/value cache: greedy, or temperature + top-p (nucleus).

The cache is the seam ``GPT.forward(ids, cache=...)`` takes: the prompt is run once (prefill),
then each new token costs one position instead of a forward over the whole sequence. It is our
own ~40 lines rather than transformers' ``DynamicCache`` because the megafixed model is not a
transformers model; the exported model (``megafixed export hf``) uses transformers' own cache, and
the tests check that both give the same greedy tokens.

Sampling follows transformers' order of logits processors (temperature, then top-p keeping the
smallest set of tokens whose probability reaches ``top_p``, always at least one), drawing from a
``torch.Generator`` seeded by ``seed``: the same seed gives the same text on the same device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch


class GenerationError(ValueError):
    """A bad generation setting; the message names the flag."""


class LayerCache:
    """One layer's keys and values ``[B, S, kv_heads, head_dim]``, preallocated to ``capacity``."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            shape = (k.shape[0], self.capacity, *k.shape[2:])
            self.k, self.v = k.new_empty(shape), v.new_empty(shape)
        end = self.length + k.shape[1]
        if end > self.capacity:
            raise GenerationError(f"the key/value cache holds {self.capacity} positions; {end} were asked")
        self.k[:, self.length:end], self.v[:, self.length:end] = k, v
        self.length = end
        return self.k[:, :end], self.v[:, :end]


class KVCache:
    """Per-layer caches; ``length`` is the number of positions already processed."""

    def __init__(self, n_layers: int, capacity: int):
        self.layers = [LayerCache(capacity) for _ in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0
    seed: int = 0
    stop_id: Optional[int] = None  # end-of-document id: generation ends after emitting it
    stop_ids: tuple = ()  # more ids that end it (a model's eos_token_id may be a list)

    def validate(self) -> "SamplingConfig":
        if self.max_new_tokens < 0:
            raise GenerationError(f"--max-new-tokens {self.max_new_tokens} must be >= 0")
        if not self.temperature >= 0:
            raise GenerationError(f"--temperature {self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"--top-p {self.top_p} must be in (0, 1]")
        return self


def next_token(logits: torch.Tensor, cfg: SamplingConfig, gen: Optional[torch.Generator]) -> torch.Tensor:
    """One token id per row of ``logits`` ``[B, V]`` (fp32)."""
    if cfg.temperature == 0:
        return logits.argmax(-1)
    logits = logits / cfg.temperature
    if cfg.top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the first one always stays)
        drop = probs.cumsum(-1) - probs >= cfg.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def stream_tokens(model, prompt: torch.Tensor, cfg: SamplingConfig) -> Iterator[int]:
    """Yield new token ids one at a time (1-D ``prompt``), stopping at ``cfg.max_new_tokens``,
    after ``cfg.stop_id``, or when the model's context (``max_seq_len``) is full."""
    cfg.validate()
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = prompt.reshape(1, -1).to(device)
    if ids.shape[1] < 1:
        raise GenerationError("the prompt is empty; give at least one token of text")
    limit = model.cfg.max_seq_len
    if ids.shape[1] > limit:
        raise GenerationError(f"the prompt has {ids.shape[1]} tokens, more than the model's context of {limit} "
                              f"(model.max_seq_len); shorten it")
    steps = min(cfg.max_new_tokens, limit - ids.shape[1] + 1)
    gen = None
    if cfg.temperature > 0:
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
    cache = KVCache(len(model.blocks), ids.shape[1] + steps)
    try:
        for i in range(steps):
            logits = model(ids, cache=cache)[:, -1].float()
            nxt = next_token(logits, cfg, gen)
            token = int(nxt[0])
            yield token
            if token == cfg.stop_id or token in cfg.stop_ids or i == steps - 1:
                break
            ids = nxt.reshape(1, 1)
    finally:
        model.train(was_training)


def generate(model, prompt: torch.Tensor, cfg: SamplingConfig,
             on_token: Optional[Callable[[int], None]] = None) -> list[int]:
    """All new token ids (see :func:`stream_tokens`); ``on_token`` is called as each one arrives."""
    out = []
    for token in stream_tokens(model, prompt, cfg):
        out.append(token)
        if on_token is not None:
            on_token(token)
    return out


def complete(model, tok, prompt: str, cfg: SamplingConfig,
             on_token: Optional[Callable[[int], None]] = None) -> str:
    """The decoded text ``model`` adds to ``prompt`` (``tok`` encodes and decodes): the one path of
    ``megafixed generate`` and the quickstart's samples, so both print the same greedy text."""
    ids = torch.tensor(tok.encode(prompt), dtype=torch.long)
    return tok.decode(generate(model, ids, cfg, on_token=on_token))
