"""The sizes of DeepSpeed's own ZeRO buffers that ``config.py`` writes into its config and
``planner.py`` counts: one place, so the plan cannot assume other buffers than the run gets. Light:
constants only (the planner must not import DeepSpeed).

All are DeepSpeed 0.19's defaults, written out rather than left implicit: a new default would
otherwise change the run's memory under an unchanged plan.
"""
from __future__ import annotations

# ZeRO-3 (``stage3_*`` keys): parameters of at most this many elements stay whole on every rank
# (norms; a small model's matrices too), gathered once and never released.
PERSISTENCE_THRESHOLD = 100_000
# Elements all-gathered ahead of the module that needs them, into one flat buffer per fetch.
PREFETCH_BUCKET = 50_000_000
# A gathered parameter is not released while it is used again within this many elements of the
# module trace: from forward to backward, the layers after it, traversed twice.
MAX_REUSE_DISTANCE = 1_000_000_000
MAX_LIVE_PARAMETERS = 1_000_000_000  # caps prefetching only (the trace's own fetches are not capped)

# Not a config key: the BF16 optimizer (bf16 at ZeRO 1) all-reduces its fp32 gradients through the
# engine's ``allreduce_gradients``, which flattens them in buckets of DeepSpeed's
# ``MEMORY_OPT_ALLREDUCE_SIZE`` elements (runtime/engine.py).
BF16_ALLREDUCE_BUCKET = 500_000_000


def stage3_keys() -> dict:
    """The ``zero_optimization`` keys of the sizes above."""
    return {"stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
            "stage3_prefetch_bucket_size": PREFETCH_BUCKET,
            "stage3_max_reuse_distance": MAX_REUSE_DISTANCE,
            "stage3_max_live_parameters": MAX_LIVE_PARAMETERS}
