"""Parallelism, applied to the plain model from outside (torchtitan's shape).

THE SEAM the trainer uses (keep these two signatures stable):

    topo  = setup_distributed(cfg)      -> Topology
    model = build_model(cfg, topo)      -> nn.Module (a GPT, a TP-applied GPT) or a
                                           deepspeed.pipe.PipelineModule when parallel.pp > 1

The trainer passes ``topo.mpu`` (None without tensor/pipeline parallelism) to
``deepspeed.initialize(mpu=...)`` and uses ``engine.train_batch`` when the model is a
PipelineModule. This first version covers data parallelism only; tensor and pipeline
parallelism extend ``topology.py``, ``tensor.py`` and ``pipeline.py`` beside this file.
"""
from __future__ import annotations

from .topology import Topology, setup_distributed  # noqa: F401


def build_model(cfg, topo: "Topology"):
    """The model for this rank's place in the layout, with the same initial weights as one process."""
    import torch

    from ..model import GPT

    if cfg.parallel.tp > 1 or cfg.parallel.pp > 1:
        raise NotImplementedError("tensor/pipeline parallelism is not built yet (issue [parallel])")
    torch.manual_seed(cfg.train.seed)
    return GPT(cfg.model)
