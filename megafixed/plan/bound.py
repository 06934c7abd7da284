"""A row's analytic traffic (``parallel.traffic``) and its step-time lower bound: the dense matmul FLOPs
at the GPU's peak, stretched by the pipeline bubble where the engine models its pipeline, against the
collectives' bus bytes at the links' data-sheet bandwidth (``parallel.device_specs``)."""
from __future__ import annotations


def _strides(layout) -> dict:
    """Each axis' (group size, rank stride) in the plan's grid order (tp fastest, then cp, then dp, then
    pp: ``parallel.dims``). The data-parallel groups a step's gradients reduce over span cp too (FSDP2's
    shard group is torchtitan's ``dp_shard_cp``; ZeRO's, DeepSpeed's sequence-data-parallel group)."""
    shard = layout.dp_shard  # cp folded in
    return {"tp": (layout.tp, 1), "cp": (layout.cp, layout.tp), "dp_shard": (shard, layout.tp),
            "dp": (layout.dp_cp, layout.tp), "dp_replicate": (layout.dp_replicate, layout.tp * shard),
            "pp": (layout.pp, layout.tp * layout.dp_cp)}


def spans_nodes(layout, axis: str, gpus_per_node: int) -> bool:
    """Whether ``axis``' groups cross a node boundary: its ranks span ``size * stride`` consecutive ranks
    (cp's sit next to tp's, so a cp group stays in a node while ``tp * cp`` <= GPUs per node)."""
    size, stride = _strides(layout)[axis]
    return size * stride > gpus_per_node


# Axes whose collectives sit between dependent matmuls and so add to the compute time rather than
# hide under it: tensor parallelism's (the all-reduce or reduce-scatter after a row-parallel matmul
# feeds the next op at once, in both engines: DTensor TP without async TP, megatron-core without
# userbuffer overlap). FSDP's gathers and reductions are prefetched and overlap; so, in the bound,
# do the pipeline's sends.
SERIAL_AXES = ("tp",)
# Kinds that do so on any axis: Ulysses' all-to-alls, whose output the attention kernel (or ``wo``)
# needs at once. Ring attention's key/value passes overlap the blocks' attention, as torch's does.
SERIAL_KINDS = ("all_to_all",)


def step_time_bound(m, traffic, layout, args, n_params: int, tokens: int, bubble: float = 0.0) -> dict | None:
    """A lower bound on one step's seconds, and its parts: the dense matmul FLOPs at the GPU's peak
    (times ``1 + bubble``, a pipeline's idle fraction from its schedule's action table) plus the
    collectives that cannot overlap them (``SERIAL_AXES``), against all the collectives' bus bytes
    at the links' data-sheet bandwidth: ``max(compute + serial, comm)``. An estimate: real steps are
    slower (kernel efficiency, imperfect overlap, latency, the memory-bound kernels and the
    optimizer step, which it leaves out)."""
    from ..parallel.device_specs import NODE_LINK, link, spec_for
    from ..parallel.traffic import bus_factor

    spec = spec_for(args.gpu_type)
    inter = link(args.inter)
    if spec is None or inter is None or spec.part not in NODE_LINK:
        return None
    intra = link(NODE_LINK[spec.part])
    world = layout.tp * layout.pp * layout.dp_cp
    recompute = 4 / 3 if layout.activation_checkpointing else 1.0
    compute_s = 6 * n_params * tokens * recompute / world / (spec.bf16_tflops * 1e12) * (1 + bubble)
    comm_s = serial_s = 0.0
    for (axis, kind), nbytes in traffic.bytes.items():
        size, _ = _strides(layout)[axis]
        bw = inter if spans_nodes(layout, axis, args.gpus_per_node) else intra
        seconds = nbytes * bus_factor(kind, size) / (bw.gbps_per_gpu * 1e9)
        comm_s += seconds
        serial_s += seconds if axis in SERIAL_AXES or kind in SERIAL_KINDS else 0.0
    return {"compute_s": compute_s, "comm_s": comm_s, "serial_comm_s": serial_s,
            "step_s_lower_bound": max(compute_s + serial_s, comm_s), "bubble": bubble, "gpu": spec.part,
            "intra": intra.name, "inter": inter.name}


def row_extras(cfg, e, args, fake: dict | None, precision: str) -> dict:
    """The per-row fields beside the memory estimate: analytic traffic and its step-time bound, and
    the fake measurement (None: not asked for)."""
    from ..parallel.memory import GiB, tp_param_counts
    from ..parallel.traffic import traffic
    from .rank import not_judged

    t = traffic(cfg.model, cfg.data.seq_len, e.layout, precision)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    bubble = e.pipeline["bubble_fraction"] if e.pipeline else 0.0
    bound = step_time_bound(cfg.model, t, e.layout, args, tp_param_counts(cfg.model).total, tokens, bubble)
    # total = tensors (what --fake measures) + the fixed reserve (what it cannot see)
    out = {"total_gib": e.total / GiB, "tensors_gib": e.tensors / GiB, "reserve_gib": e.reserve / GiB,
           "comm_bytes": t.total, "traffic": t.as_dict(), "step_time_estimate": bound,
           "not_judged": not_judged(e, bound)}
    if fake is not None:
        add_fake(out, fake)
    return out


def add_fake(extras: dict, fake: dict) -> None:
    """A row's fake measurement beside its analytic fields (``row_extras``)."""
    from ..parallel.memory import GiB

    measured = "refused" not in fake
    extras.update(fake_peak_gib=fake["peak_bytes"] / GiB if measured else None,
                  fake_comm_bytes=sum(c["bytes"] for c in fake["comm"].values()) if measured else None,
                  fake=fake)
