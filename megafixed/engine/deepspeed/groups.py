"""The DeepSpeed engine's process groups: megatron-core's ``parallel_state`` under TP/PP (its
layers find their TP group there, so its groups are the ones the Topology keeps)."""
from __future__ import annotations


def megatron_groups(plan) -> dict:
    """The Topology's group fields for ``plan`` (none for one TP and PP rank: plain data parallelism)."""
    if plan.tp == 1 and plan.pp == 1:
        return {}
    # megatron-core's default order (tp-cp-ep-dp-pp) is the plan's grid order.
    from .megatron_tp import load

    ps = load().parallel_state  # without the rest of megatron-core (megatron_tp.py)
    if not ps.model_parallel_is_initialized():
        # megatron passes its own timeout (30 minutes) to every group it makes: give it the run's bound
        ps.initialize_model_parallel(tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=plan.pp,
                                     create_gloo_process_groups=False,
                                     distributed_timeout_minutes=plan.collective_timeout_s / 60)
    return dict(tp_group=ps.get_tensor_model_parallel_group(), dp_group=ps.get_data_parallel_group(),
                model_parallel_group=ps.get_model_parallel_group())
