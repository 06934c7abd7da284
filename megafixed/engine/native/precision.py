"""FSDP2's mixed-precision policy for a plan's precision (shared by the plain and the pipeline build)."""
from __future__ import annotations

import torch

from ..dtypes import COMPUTE_DTYPES


def mixed_precision_policy(precision: str):
    """FSDP2's policy for the plan's precision: bf16 compute on fp32 master weights with fp32
    gradient reduction (``reduce_dtype``: a reduce-scatter in bf16 would round every rank's
    gradient before the sum); fp32 trains in fp32 throughout (the default policy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPES[precision], reduce_dtype=torch.float32)
