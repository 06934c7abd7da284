"""Pipeline parallelism: the GPT cut into DeepSpeed pipeline stages (``deepspeed.pipe``).

The full GPT is built (same seed) on every rank and its modules are handed to the stages, so a
pipeline run starts from exactly the single-process weights; ``PipelineModule`` keeps only this
stage's layers (the rest are freed with the full model). Layer list::

    [PipeInput (codes or table)] + [PipeBlock] * n_layers + [PipeHead (norm + proj)]

and the loss (``GPT.loss``, or the vocab-parallel loss under TP) runs on the last stage. Stages pass
one activation tensor ``[B, T, D]`` (``[B, T/tp, D]`` under sequence parallelism) -- DeepSpeed pipe
only sends tensors. Each block reads the fp32 RoPE tables through the model's ``Rotary`` (a cache,
not buffers, so DeepSpeed's bf16 cast of every stage cannot touch them). The engine's schedule is
1F1B (``engine.train_batch``). The model arrives on the meta device; ``PipelineModule`` keeps only
this stage's layers, and ``build_model`` materialises just those.

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


def _pipeline_module_class():
    from deepspeed.pipe import PipelineModule

    class GPTPipelineModule(PipelineModule):
        """DeepSpeed's PipelineModule plus the once-per-step sequence-parallel gradient sum.

        DeepSpeed's pipeline engine calls ``get_tied_weights_and_groups`` exactly once per
        optimizer step, in its ``ReduceTiedGrads`` instruction, right before the data-parallel
        ``ReduceGrads``: the accumulation boundary where Megatron's ``finalize_model_grads`` runs.
        We use that seam for one coalesced TP all-reduce (``megafixed.parallel.grads``).
        """

        grad_sync = None  # a TPGradSync, set by build_model under sequence parallelism

        def __init__(self, *args, materialize=None, **kwargs):
            # Set before PipelineModule.__init__, which calls _build (plain attribute, not a Module).
            object.__setattr__(self, "_materialize", materialize)
            super().__init__(*args, **kwargs)

        def _build(self):
            # DeepSpeed keeps this stage's layers in _build and then moves the module to its
            # device; the layers are still meta tensors, so give them storage and their values first.
            super()._build()
            if self._materialize is not None:
                self._materialize(self)

        def get_tied_weights_and_groups(self):
            if self.grad_sync is not None:
                self.grad_sync.finish()
            return super().get_tied_weights_and_groups()

    return GPTPipelineModule


def build_pipeline(model, topo, partition: str = "parameters", activation_checkpointing: bool = False,
                   materialize=None):
    """A ``PipelineModule`` holding this rank's stage of ``model`` (normally still on meta);
    ``materialize(stage_module)`` gives the kept layers storage and values."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    # The pipeline grid is built through deepspeed.comm, which wraps the torch process group
    # setup_distributed already made.
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    seq_shards = topo.tp if topo.sequence_parallel else 1
    grid = PipeModelDataParallelTopology(num_pp=topo.pp, num_mp=topo.tp, num_dp=topo.dp)
    module = _pipeline_module_class()(
        layers=pipeline_layers(model, seq_shards), loss_fn=model.loss_fn, topology=grid,
        partition_method=PARTITION_METHODS[partition],
        activation_checkpoint_interval=1 if activation_checkpointing else 0,
        # non-reentrant: with fixed codes the first stage's activations do not require grad,
        # which reentrant checkpointing cannot handle
        activation_checkpoint_func=partial(torch.utils.checkpoint.checkpoint, use_reentrant=False),
        materialize=materialize)
    if module._grid.get_stage_id() != topo.pp_rank or module._grid.get_data_parallel_id() != topo.dp_rank:
        raise RuntimeError("DeepSpeed's pipeline grid disagrees with the Topology's rank order")  # a bug, not input
    return module


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
