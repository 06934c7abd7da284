"""Pipeline parallelism, engine-agnostic half: the GPT as an ordered list of pipeline layers and
the names its parameters take there. The stages themselves are an engine's (the DeepSpeed one:
``megafixed.engine.deepspeed.pipeline``, ``deepspeed.pipe``).

The GPT is built on the meta device (no memory) and its modules are handed to the stages; the
engine keeps only this stage's layers and ``build_model`` materialises just those, from the same
per-parameter generators, so a pipeline run starts from exactly the single-process weights.
Layer list::

    [PipeInput (codes or table)] + [PipeBlock] * n_layers + [PipeHead (norm + proj)]

and the loss (``model.loss_fn``, or the vocab-parallel loss under TP) runs on the last stage. Stages pass
one activation tensor ``[B, T, D]`` (``[B, T/tp, D]`` under sequence parallelism) -- DeepSpeed pipe
only sends tensors. Each block reads the fp32 RoPE tables through the model's ``Rotary`` (a cache,
not buffers, so DeepSpeed's bf16 cast of every stage cannot touch them). The engine's schedule is
1F1B (``engine.train_batch``).

Balancing: ``parallel.pp_partition=parameters`` (default) balances trainable parameters. With
fixed codes the input layer has none, so the first stage simply takes more blocks, while the
output head (d x V parameters) weighs on the last stage -- the parameter balance then also tracks
memory. ``type:Block`` puts the same number of blocks on each stage (balanced compute when the
head is small); ``uniform`` counts every layer alike.
"""
from __future__ import annotations

from torch import nn

PARTITION_METHODS = {"parameters": "parameters", "uniform": "uniform", "type:Block": "type:PipeBlock"}


class PipeInput(nn.Module):
    """Token ids -> first activations (fixed codes: no parameters; learned: the table)."""

    def __init__(self, input_module: nn.Module):
        super().__init__()
        self.input = input_module

    def forward(self, ids):
        return self.input(ids)


class PipeBlock(nn.Module):
    """One transformer block; RoPE tables come from the shared fp32 ``Rotary`` cache."""

    def __init__(self, block: nn.Module, rotary: nn.Module, seq_shards: int):
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.seq_shards = seq_shards  # tp under sequence parallelism: x holds T/tp positions

    def forward(self, x):
        cos, sin = self.rotary(x.shape[1] * self.seq_shards, x.device)
        return self.block(x, cos, sin)


class PipeHead(nn.Module):
    """Final norm + output projection (logits, vocab-sharded under TP)."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, x):
        return self.head(x)


def pipeline_layers(model, seq_shards: int = 1) -> list[nn.Module]:
    """The GPT's modules as an ordered list of pipeline layers (the converter relies on this
    order: layer 0 input, 1..L blocks, L+1 head). ``seq_shards`` is tp under sequence parallelism."""
    blocks = [PipeBlock(b, model.rotary, seq_shards) for b in model.blocks]
    return [PipeInput(model.input), *blocks, PipeHead(model.head)]


def layer_prefix(layer_idx: int, n_layers: int) -> str:
    """Plain-GPT state-dict prefix of pipeline layer ``layer_idx`` (used by the converter)."""
    if layer_idx == 0:
        return "input."
    if layer_idx <= n_layers:
        return f"blocks.{layer_idx - 1}."
    return "head."


def pipe_key_to_gpt(layer_idx: int, key: str, n_layers: int) -> str:
    """``(3, 'block.attn.wq.weight')`` -> ``'blocks.2.attn.wq.weight'``."""
    for inner in ("input.", "block.", "head."):
        if key.startswith(inner):
            return layer_prefix(layer_idx, n_layers) + key[len(inner):]
    raise ValueError(f"unexpected pipeline layer key {key!r} in layer {layer_idx}")


def gpt_key_to_pipe(key: str, n_layers: int) -> tuple[int, str]:
    """Inverse of ``pipe_key_to_gpt``."""
    if key.startswith("input."):
        return 0, key
    if key.startswith("head."):
        return n_layers + 1, key
    if key.startswith("blocks."):
        _, idx, rest = key.split(".", 2)
        return int(idx) + 1, "block." + rest
    raise ValueError(f"unexpected GPT state-dict key {key!r}")
