"""The global gradient norm with every parameter counted once across tensor and pipeline ranks.

Why not DeepSpeed's ``get_flattened_grad_norm``: it sums every local gradient on every rank, so a
parameter replicated across the TP group (norm weights, row-parallel biases) is counted ``tp``
times. DeepSpeed's ZeRO optimizers and its ``clip_grad_norm_`` use the Megatron rule instead
(count a parameter if it is TP-sharded, ``tensor_model_parallel=True``, or if this is TP rank 0),
which this function applies too, on data-parallel rank 0, summing squares over the whole job in one
all-reduce. Gradients must already be reduced across data-parallel ranks.

Why not one norm for both engines: the torch engine's ``native.step.grad_norm`` means the same
number (float64 sum of squares, each parameter once across the mesh, then the root) but reaches it
by another mechanism -- its gradients are DTensors whose placements say what is sharded and torch
reduces each mesh's norm itself -- whereas here the gradients are plain tensors that only
megatron-core's ``tensor_model_parallel`` attribute marks, so the counting rule and the all-reduce
are ours. Neither function accepts the other's gradients.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def is_tp_sharded(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))


def global_grad_norm(parameters, mpu=None) -> float:
    """L2 norm of the whole model's gradient; ``mpu`` is ``topology_mpu(topo)`` or DeepSpeed's pipeline grid.

    One all-reduce over the whole job, the data-parallel replicas adding zeros (their gradients are
    already the DP mean, equal on every replica): every rank gets the same bits, which the bad-step
    guard relies on; a sum over each replica's model-parallel group would be one communicator per
    replica, which promises no such thing."""
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

    tp_rank = bwc_tensor_model_parallel_rank(mpu)
    # one replica of the reduced gradients: data-parallel rank 0, and context-parallel rank 0 under cp
    # (ContextParallelMPU: its data x context rank)
    seq_dp_rank = getattr(mpu, "get_sequence_data_parallel_rank", None)
    dp_rank = seq_dp_rank() if seq_dp_rank else mpu.get_data_parallel_rank() if mpu is not None else 0
    params = [p for p in parameters if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if dp_rank == 0 and (tp_rank == 0 or is_tp_sharded(p)):
            squares += p.grad.detach().double().pow(2).sum()
    if mpu is not None and dist.is_initialized():
        dist.all_reduce(squares)
    return float(squares.sqrt())
