"""DeepSpeed's model-parallel unit, answered from the Topology (only the DeepSpeed engine asks
for one)."""
from __future__ import annotations


def topology_mpu(topo):
    """The model-parallel unit for ``deepspeed.initialize(mpu=...)``: needed under TP so that ZeRO
    partitions over the DP group and the gradient norm counts each parameter once, and under CP so
    that ZeRO partitions and reduces over data x context ranks. With a pipeline, DeepSpeed insists
    on None and builds its grid from the same numbers (the run plan refuses CP with a pipeline)."""
    if topo.pp > 1:
        return None
    if topo.cp > 1:
        return ContextParallelMPU(topo)
    return TopologyMPU(topo) if topo.tp > 1 else None


class TopologyMPU:
    """The model-parallel unit DeepSpeed 0.19 queries, answered from the Topology.

    megatron-core 0.16 no longer has ``get_model_parallel_rank/world_size`` (DeepSpeed still calls
    them for checkpoint file names and the gradient-norm reduction), so this adapter spells out
    exactly the calls DeepSpeed makes. "Model parallel" means TP x PP (one model replica).
    """

    def __init__(self, topo):  # a megafixed.parallel.topology.Topology
        self.topo = topo

    # tensor parallel
    def get_tensor_model_parallel_rank(self) -> int:
        return self.topo.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.topo.tp

    def get_tensor_model_parallel_group(self):
        return self.topo.tp_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.topo.rank - self.topo.tp_rank

    # pipeline parallel
    def get_pipeline_model_parallel_rank(self) -> int:
        return self.topo.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.topo.pp

    def get_pipeline_model_parallel_group(self):
        from .megatron_tp import load
        return load().parallel_state.get_pipeline_model_parallel_group()

    # model parallel = one replica (TP x PP)
    def get_model_parallel_group(self):
        return self.topo.model_parallel_group

    def get_model_parallel_world_size(self) -> int:
        return self.topo.tp * self.topo.pp

    def get_model_parallel_rank(self) -> int:
        return self.topo.pp_rank * self.topo.tp + self.topo.tp_rank

    # data parallel
    def get_data_parallel_group(self):
        return self.topo.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.topo.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.topo.dp

    def get_data_parallel_group_ranks(self) -> list[int]:
        import torch.distributed as dist
        return dist.get_process_group_ranks(self.topo.dp_group)


class ContextParallelMPU(TopologyMPU):
    """``TopologyMPU`` with DeepSpeed's sequence-parallel questions answered (context parallelism).

    DeepSpeed 0.19 takes ZeRO's partition and gradient-reduction group from
    ``get_sequence_data_parallel_group`` (data x context ranks: each context-parallel rank holds the
    gradient of other tokens) and divides that reduction by its size over the sequence-parallel size,
    i.e. by dp alone: it sums over the cp ranks (``engine._reduce_non_expert_gradients``,
    ``stage_1_and_2.average_tensor``, ``stage3``). The step divides each rank's loss by cp before its
    backward (``step.train_step``), so that sum is the mean over every token. Only a run with cp > 1
    has these methods: DeepSpeed asks for them with ``hasattr``, and a run without cp keeps its path."""

    def get_sequence_parallel_group(self):
        return self.topo.cp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.topo.cp

    def get_sequence_parallel_rank(self) -> int:
        return self.topo.cp_rank

    def get_sequence_data_parallel_group(self):
        return self.topo.dp_cp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.topo.dp * self.topo.cp

    def get_sequence_data_parallel_rank(self) -> int:
        return self.topo.dp_rank * self.topo.cp + self.topo.cp_rank
