"""The parts of megatron-core the DeepSpeed engine uses, imported on first use.

``tensor_parallel.layers`` (Column/Row parallel Linear, VocabParallelEmbedding, the TP attributes),
``tensor_parallel.cross_entropy``, ``parallel_state`` and ``ModelParallelConfig``. Importing them runs
megatron-core's package ``__init__`` (seconds per rank), so only a run with TP or PP above 1 pays it.
"""
from __future__ import annotations

import functools
import types


@functools.cache
def load() -> types.SimpleNamespace:
    """``parallel_state``, ``ModelParallelConfig``, ``layers`` and ``cross_entropy`` of megatron-core
    (imported once per process; later calls return the same namespace)."""
    from megatron.core import model_parallel_config, parallel_state
    from megatron.core.tensor_parallel import cross_entropy, layers

    return types.SimpleNamespace(parallel_state=parallel_state, model_parallel_config=model_parallel_config,
                                 ModelParallelConfig=model_parallel_config.ModelParallelConfig,
                                 cross_entropy=cross_entropy, layers=layers)
