"""Parallelism, applied to the plain model from outside (torchtitan's shape).

The seam the trainer, evaluation and tests use::

    topo   = setup_distributed(RunPlan.for_launch(cfg))  # once per process -> Topology
    # the DeepSpeed engine's model builder is megafixed.engine.deepspeed.model.build_model

Each kind of parallelism lives in its own module and takes the model config plus the topology:
``layout.py`` (the one validator), ``topology.py`` (process groups, made by the plan's engine),
``tensor.py`` (the engine-neutral TP plan), ``pipeline.py`` (the layer list of pipeline stages; the
stages are the engine's), ``sequence.py`` (SP collectives), ``memory.py`` (``megafixed plan``'s
common arithmetic; each engine's sharding arithmetic is its planner's) and ``device_specs.py`` (the GPUs'
data-sheet peaks and links). Nothing here imports an engine library: the megatron-core layers, the model
builder, the TP gradient sync and DeepSpeed's model-parallel unit are ``megafixed/engine/deepspeed/``'s.
"""
from __future__ import annotations

from .layout import BatchLayout, LayoutError, batch_layout, check_layout, validate_layout  # noqa: F401
from .topology import Topology, setup_distributed  # noqa: F401
