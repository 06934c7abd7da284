"""Context parallelism in the torch engine's build (``build.py``, ``pipeline.py``): Ulysses around every
attention core after TP, and FSDP2 wherever dp x cp ranks reduce gradients (``mesh.dp_mesh``: over
dp_shard x cp). The layer itself is ``megafixed.parallel.context``."""
from __future__ import annotations


def shards_state(plan) -> bool:
    """Whether FSDP2 wraps the model: more than one rank reduces its gradients (dp x cp; each
    context-parallel rank's gradients come from other tokens of the same sequences)."""
    return plan.dp * plan.cp > 1


def apply_cp(model, cfg, topo) -> None:
    """Context parallelism (parallel.cp > 1): RoPE from this rank's first position and Ulysses'
    all-to-all around every attention core (``megafixed.parallel.context``); parameters untouched."""
    if topo.plan.cp == 1 or topo.plan.cp_method == "ring":  # ring: ring.batch_context shards each micro batch
        return
    from ...parallel.context import UlyssesAttention, shard_model

    shard_model(model, topo.cp_rank, topo.cp, cfg.data.seq_len,
                lambda core: UlyssesAttention(core, topo.cp_group, topo.cp))
