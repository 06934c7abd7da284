"""Parallelism, applied to the plain model from outside (torchtitan's shape).

THE SEAM the trainer uses (keep these two signatures stable):

    topo  = setup_distributed(cfg)      -> Topology
    model = build_model(cfg, topo)      -> nn.Module (a GPT, a TP-applied GPT) or a
                                           deepspeed.pipe.PipelineModule when parallel.pp > 1

The trainer passes ``topo.mpu`` to ``deepspeed.initialize(mpu=...)``: a megatron-core backed unit
under tensor parallelism, None otherwise (with pipelines DeepSpeed insists on None and uses the
PipelineModule's own grid, built in the same rank order). It steps with ``engine.train_batch``
when the model is a PipelineModule. ``topology.py`` checks the layout and builds the groups, ``tensor.py`` applies
megatron-core tensor (and sequence) parallel layers, ``pipeline.py`` cuts the model into DeepSpeed
pipeline stages, ``sequence.py`` holds the sequence-parallel collectives, ``grad_norm.py`` the
gradient norm that counts each parameter once, ``convert.py`` moves checkpoints between layouts
and ``memory.py`` estimates memory per GPU (``megafixed plan``).
"""
from __future__ import annotations

from .topology import LayoutError, Topology, check_layout, setup_distributed  # noqa: F401


def build_model(cfg, topo: "Topology"):
    """The model for this rank's place in the layout, with the same initial weights as one process.

    Every rank builds the full GPT from the same seed, then keeps its shard (TP) and/or its
    stage (PP); weights therefore equal the single-process model's exactly.
    """
    import torch

    from ..model import GPT

    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    if cfg.parallel.tp > 1:
        from .tensor import apply_tp
        apply_tp(model, cfg, topo.tp_rank)
    if cfg.parallel.pp > 1:
        from .pipeline import build_pipeline
        return build_pipeline(model, cfg, topo)
    return model
