"""DeepSpeed's pipeline stages (``deepspeed.pipe.PipelineModule``) over the layer list of
``megafixed.parallel.pipeline``, and DeepSpeed's stage partitioner for the planner."""
from __future__ import annotations

from functools import partial

import torch
import torch.utils.checkpoint

from ...parallel.pipeline import PARTITION_METHODS, pipeline_layers


def _pipeline_module_class():
    from deepspeed.pipe import PipelineModule

    class GPTPipelineModule(PipelineModule):
        """DeepSpeed's PipelineModule plus the once-per-step sequence-parallel gradient sum.

        DeepSpeed's pipeline engine calls ``get_tied_weights_and_groups`` exactly once per
        optimizer step, in its ``ReduceTiedGrads`` instruction, right before the data-parallel
        ``ReduceGrads``: the accumulation boundary where Megatron's ``finalize_model_grads`` runs.
        We use that seam for one coalesced TP all-reduce (``megafixed.engine.deepspeed.grads``).
        """

        grad_sync = None  # a TPGradSync, set by the engine builder under sequence parallelism

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


def partition(weights: list, parts: int, method: str) -> list[int]:
    """Stage boundaries as ``PipelineModule`` computes them (``method``: "uniform" over
    ``len(weights)`` layers, or "balanced" over the per-layer ``weights``)."""
    from deepspeed.runtime import utils as ds_utils

    if method == "uniform":
        return ds_utils.partition_uniform(num_items=len(weights), num_parts=parts)
    return ds_utils.partition_balanced(weights=weights, num_parts=parts)
