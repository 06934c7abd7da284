"""The DeepSpeed engine's process groups: megatron-core's ``parallel_state`` under TP/PP/CP (its
layers find their TP group there, so its groups are the ones the Topology keeps)."""
from __future__ import annotations


def megatron_groups(plan) -> dict:
    """The Topology's group fields for ``plan`` (none for one TP, PP and CP rank: plain data parallelism)."""
    cp = getattr(plan, "cp", 1)  # a plan of a layout without the axis (a test's stand-in) has none
    if plan.tp == 1 and plan.pp == 1 and cp == 1:
        return {}
    # megatron-core's default order (tp-cp-ep-dp-pp) is the plan's grid order.
    from .megatron_tp import load

    ps = load().parallel_state  # without the rest of megatron-core (megatron_tp.py)
    if not ps.model_parallel_is_initialized():
        # megatron passes its own timeout (30 minutes) to every group it makes: give it the run's bound
        ps.initialize_model_parallel(tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=plan.pp,
                                     context_parallel_size=cp, create_gloo_process_groups=False,
                                     distributed_timeout_minutes=plan.collective_timeout_s / 60)
    groups = dict(tp_group=ps.get_tensor_model_parallel_group(), dp_group=ps.get_data_parallel_group(),
                  model_parallel_group=ps.get_model_parallel_group())
    if cp > 1:
        # megatron's data-parallel group leaves cp out; ZeRO and the loss span data x context ranks
        groups.update(cp_group=ps.get_context_parallel_group(),
                      dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True))
    return groups
