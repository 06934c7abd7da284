"""Pipeline parallelism: the GPT cut into DeepSpeed pipeline stages (``deepspeed.pipe``).

The full GPT is built (same seed) on every rank and its modules are handed to the stages, so a
pipeline run starts from exactly the single-process weights; ``PipelineModule`` keeps only this
stage's layers (the rest are freed with the full model). Layer list::

    [PipeInput (codes or table)] + [PipeBlock] * n_layers + [PipeHead (norm + proj)]

and the loss (``GPT.loss``, or the vocab-parallel loss under TP) runs on the last stage. Stages pass
one activation tensor ``[B, T, D]`` (``[B, T/tp, D]`` under sequence parallelism) -- DeepSpeed pipe
only sends tensors. Each block carries its own copy of the RoPE tables as non-persistent buffers,
so no stage needs the model's buffers or extra traffic. The engine's schedule is 1F1B
(``engine.train_batch``).

Balancing: ``parallel.pp_partition=parameters`` (default) balances trainable parameters. With
fixed codes the input layer has none, so the first stage simply takes more blocks, while the
output head (d x V parameters) weighs on the last stage -- the parameter balance then also tracks
memory. ``type:Block`` puts the same number of blocks on each stage (balanced compute when the
head is small); ``uniform`` counts every layer alike.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.utils.checkpoint
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
    """One transformer block with its own RoPE tables (stages share no buffers)."""

    def __init__(self, block: nn.Module, rope_cos: torch.Tensor, rope_sin: torch.Tensor, seq_shards: int):
        super().__init__()
        self.block = block
        self.register_buffer("rope_cos", rope_cos.clone(), persistent=False)
        self.register_buffer("rope_sin", rope_sin.clone(), persistent=False)
        self.seq_shards = seq_shards  # tp under sequence parallelism: x holds T/tp positions

    def forward(self, x):
        T = x.shape[1] * self.seq_shards
        return self.block(x, self.rope_cos[:T], self.rope_sin[:T])


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
    blocks = [PipeBlock(b, model.rope_cos, model.rope_sin, seq_shards) for b in model.blocks]
    return [PipeInput(model.input), *blocks, PipeHead(model.head)]


def build_pipeline(model, cfg, topo):
    """A ``deepspeed.pipe.PipelineModule`` holding this rank's stage of ``model``."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    # The pipeline grid is built through deepspeed.comm, which wraps the torch process group
    # setup_distributed already made (a no-op when deepspeed.initialize ran before).
    deepspeed.init_distributed(dist_backend=dist.get_backend())

    seq_shards = cfg.parallel.tp if cfg.parallel.sequence_parallel else 1
    if model.has_fixed_input:
        # The trainer sets the codes' dtype on a plain GPT; here the input layer feeds stage
        # blocks directly, so emit the compute dtype (the code is exactly +-scale in any float).
        from ..train.ds_config import resolve_precision
        precision = resolve_precision(cfg)
        if precision in ("bf16", "fp16"):
            model.input.out_dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    loss_fn = model.loss  # GPT.loss, or the vocab-parallel loss that apply_tp installed
    topology = PipeModelDataParallelTopology(num_pp=cfg.parallel.pp, num_mp=cfg.parallel.tp,
                                             num_dp=topo.dp)
    return PipelineModule(layers=pipeline_layers(model, seq_shards), loss_fn=loss_fn, topology=topology,
                          partition_method=PARTITION_METHODS[cfg.parallel.pp_partition],
                          activation_checkpoint_interval=1 if cfg.train.activation_checkpointing else 0,
                          # non-reentrant: with fixed codes the first stage's activations do
                          # not require grad, which reentrant checkpointing cannot handle
                          activation_checkpoint_func=partial(torch.utils.checkpoint.checkpoint,
                                                             use_reentrant=False))


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
