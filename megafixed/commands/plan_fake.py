"""``megafixed plan``'s measured and traffic columns: ``--fake`` (one real step per row under fake
tensors, through the engine's own build) and the analytic traffic with its step-time bound.

Each row is measured in a process of its own (``python -m <planner.FAKE_WORKER>``): a fake process
group has one world size per process, and a process per row keeps memory bounded and a failure to
its row. An engine whose planner has no ``FAKE_WORKER`` (DeepSpeed) gets its refusal in the row.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

# The fake process group holds nothing per peer, but the mesh is built in full on one process and
# a world this large is no plan anyone queues; refusing keeps --fake's cost bounded.
MAX_FAKE_WORLD = 16384
ROW_TIMEOUT_S = 1800


def add_arguments(p) -> None:
    p.add_argument("--fake", action="store_true",
                   help="measure each shown row's peak memory and collectives with one real step under fake tensors")
    p.add_argument("--gpu-type", default="H100 80GB HBM3",
                   help="GPU for the step-time bound, as torch names it (default H100 80GB HBM3)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, joined by NVLink (default 8)")
    p.add_argument("--inter", default="ib-ndr400", help="link between nodes (ib-ndr400, ib-hdr200; default ib-ndr400)")


def _strides(layout) -> dict:
    """Each axis' (group size, rank stride) in the plan's grid order (tp fastest, then dp, then pp)."""
    shard = layout.dp_shard
    return {"tp": (layout.tp, 1), "dp_shard": (shard, layout.tp), "dp": (layout.dp, layout.tp),
            "dp_replicate": (layout.dp_replicate, layout.tp * shard), "pp": (layout.pp, layout.tp * layout.dp)}


# Axes whose collectives sit between dependent matmuls and so add to the compute time rather than
# hide under it: tensor parallelism's (the all-reduce or reduce-scatter after a row-parallel matmul
# feeds the next op at once, in both engines: DTensor TP without async TP, megatron-core without
# userbuffer overlap). FSDP's gathers and reductions are prefetched and overlap; so, in the bound,
# do the pipeline's sends.
SERIAL_AXES = ("tp",)


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
    world = layout.tp * layout.pp * layout.dp
    recompute = 4 / 3 if layout.activation_checkpointing else 1.0
    compute_s = 6 * n_params * tokens * recompute / world / (spec.bf16_tflops * 1e12) * (1 + bubble)
    comm_s = serial_s = 0.0
    for (axis, kind), nbytes in traffic.bytes.items():
        size, stride = _strides(layout)[axis]
        bw = intra if size * stride <= args.gpus_per_node else inter
        seconds = nbytes * bus_factor(kind, size) / (bw.gbps_per_gpu * 1e9)
        comm_s += seconds
        serial_s += seconds if axis in SERIAL_AXES else 0.0
    return {"compute_s": compute_s, "comm_s": comm_s, "serial_comm_s": serial_s,
            "step_s_lower_bound": max(compute_s + serial_s, comm_s), "bubble": bubble, "gpu": spec.part,
            "intra": intra.name, "inter": inter.name}


def refusal(layout, planner, gpus: int) -> str | None:
    if planner.FAKE_WORKER is None:
        return planner.fake_refusal(layout)
    if gpus > MAX_FAKE_WORLD:
        return f"--fake measures up to {MAX_FAKE_WORLD} ranks, not {gpus}"
    return planner.fake_refusal(layout)


def measure_row(args, planner, layout) -> dict:
    """One row's fake measurement in its own process, or ``{"refused": why}``."""
    why = refusal(layout, planner, args.gpus)
    if why:
        return {"refused": why}
    spec = {"config": args.config, "overrides": list(args.overrides), "gpus": args.gpus,
            "precision": args.precision, "layout": asdict(layout)}
    try:
        done = subprocess.run([sys.executable, "-m", planner.FAKE_WORKER], input=json.dumps(spec),
                              capture_output=True, text=True, timeout=ROW_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"refused": f"the fake step took over {ROW_TIMEOUT_S} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"refused": f"the fake worker exited {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def measure_rows(args, planner, estimates, progress=None) -> list:
    """``measure_row`` for each estimate, one progress line each (on stderr, so --json stays one object)."""
    from ..parallel.memory import GiB

    out = []
    for i, e in enumerate(estimates, 1):
        got = measure_row(args, planner, e.layout)
        lay = e.layout
        where = f"tp {lay.tp} pp {lay.pp} dp {lay.dp} ({planner.sharding_text(lay)}) mb {lay.micro_batch}"
        if "refused" in got:
            line = f"fake {i}/{len(estimates)}: {where}: {got['refused']}"
        else:
            line = (f"fake {i}/{len(estimates)}: {where}: peak {got['peak_bytes'] / GiB:.2f} GiB "
                    f"(analytic {e.tensors / GiB:.2f} + reserve {e.reserve / GiB:.0f}) in {got['seconds']:.0f} s")
        print(line, file=progress or sys.stderr, flush=True)
        out.append(got)
    return out


def row_extras(cfg, e, args, fake: dict | None, precision: str) -> dict:
    """The per-row fields beside the memory estimate: analytic traffic and its step-time bound, and
    the fake measurement (None: not asked for)."""
    from ..parallel.memory import GiB, tp_param_counts
    from ..parallel.traffic import traffic
    from .plan_rank import not_judged

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


def columns(x: dict) -> str:
    """The table's extra columns for one row (``row_extras``)."""
    bound = x["step_time_estimate"]
    judged = bound is not None and not x.get("not_judged")
    text = f" {x['comm_bytes'] / 1e9:8.1f} " + (f"{bound['step_s_lower_bound']:7.2f}" if judged else f"{'-':>7}")
    if "fake" in x:
        if x["fake_peak_gib"] is None:
            return text + f"  {'-':>8} {'-':>8}  ({x['fake']['refused']})"
        return text + f"  {x['fake_peak_gib']:8.2f} {x['fake_comm_bytes'] / 1e9:8.1f}"
    return text


def header(fake: bool) -> str:
    return f" {'comm GB':>8} {'step>=s':>7}" + (f"  {'fake GiB':>8} {'fake GB':>8}" if fake else "")


def row_note(x: dict) -> str:
    """The end of a row: why its bound does not rank it, if so."""
    return f"  ({x['not_judged']})" if x.get("not_judged") else ""
