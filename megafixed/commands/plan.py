"""``megafixed plan CONFIG --gpus N [--gpu-mem 80GB] [--json]``: which layouts fit, and why.

Lists every feasible (TP, CP, PP, DP, ZeRO, micro-batch[, SP]) layout for N GPUs with its estimated
memory per GPU (parameters, gradients, optimizer state, activations; ``megafixed.parallel.memory``
documents the formulas), marks the ones that fit, and shows what the fixed codes save versus a
learned table of the same shape.
"""
from __future__ import annotations

import json

from ..config import ConfigError, load_config

HELP = "list feasible TP/CP/PP/DP/ZeRO layouts and their estimated memory per GPU"



def add_arguments(p):
    p.add_argument("config", help="YAML run config")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs to plan for")
    p.add_argument("--gpu-mem", default="80GiB", help="memory per GPU: 80GB = 80e9 bytes, 80GiB = 80 x 2^30 "
                                                      "(default 80GiB, an H100's)")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--all", action="store_true", help="also list layouts that do not fit")
    p.add_argument("--top", type=int, default=20, help="rows to print, the fastest first (default 20)")
    p.add_argument("--pick", type=int, default=None, metavar="K",
                   help="print row K's overrides (parallel.tp=... train.micro_batch=...) for megafixed train/submit")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.add_argument("--fake", action="store_true",
                   help="measure each shown row's peak memory and collectives with one real step under fake tensors")
    p.add_argument("--gpu-type", default="H100 80GB HBM3",
                   help="GPU for the step-time bound, as torch names it (default H100 80GB HBM3)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, joined by NVLink (default 8)")
    p.add_argument("--inter", default="ib-ndr400", help="link between nodes (ib-ndr400, ib-hdr200; default ib-ndr400)")


def _sharding(lay) -> str:
    """The sharding column of a row: the layout fields its engine's facts name (``EngineFacts.column``): the
    ZeRO stage, or under FSDP2 the HSDP degrees (replicate x shard)."""
    from ..engines import engine_kind

    return "x".join(str(getattr(lay, name)) for name in engine_kind(lay.engine).facts.column[2])


def run(args) -> int:
    from ..engine import prepare_runtime_env

    cfg = load_config(args.config, args.overrides)  # a ConfigError is reported by cli.main
    # the run's engine's environment only (DeepSpeed's partitioner sizes its pipeline rows: quiet,
    # CPU-safe); the torch engine's plan touches nothing of DeepSpeed's
    prepare_runtime_env(cfg.train.engine)
    from ..model.interfaces import interface_of
    from ..parallel.memory import GiB, fixed_code_saving, tp_param_counts
    from ..plan.rows import parse_bytes, plan_rows

    gpu_mem = parse_bytes(args.gpu_mem)
    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: the number of GPUs to plan for must be >= 1")
    budget = gpu_mem  # the room for the CUDA context, NCCL and fragmentation is each row's reserve
    from ..engines import engine_kind

    kind = engine_kind(cfg.train.engine)
    planner, facts = kind.planner, kind.facts  # the engine's sharding arithmetic; its column and notes
    zname = facts.column[0]
    from ..plan.bound import add_fake
    from ..plan.fake import measure_rows
    from ..plan.rank import config_precision, overrides_of, pick

    table = plan_rows(cfg, args.gpus, budget, args.precision, args)  # in rank order (plan.rank)
    if args.pick is not None:
        print(" ".join(pick(table, budget, args.pick, cfg, args.precision, GiB)))
        return 0
    estimates = [r.estimate for r in table]
    fitting = [e for e in estimates if e.total <= budget]
    counts = tp_param_counts(cfg.model)
    ref_layout = (fitting or estimates)[0].layout if estimates else None
    saving = fixed_code_saving(cfg.model, ref_layout, args.precision) if ref_layout else None

    shown = table if args.all else [r for r in table if r.total <= budget]
    rows = shown[:args.top]
    if args.fake:
        for r, fake in zip(rows, measure_rows(args, planner, [r.estimate for r in rows], _sharding)):
            add_fake(r.extras, fake)
    resolved = config_precision(cfg)

    def row_overrides(e):
        return overrides_of(e.layout, args.precision, resolved)

    if args.json:
        print(json.dumps({"config": args.config, "engine": cfg.train.engine, "gpus": args.gpus,
                          "gpu_mem_bytes": gpu_mem,
                          "budget_bytes": budget, "precision": args.precision,
                          "params_total": counts.total, "input": cfg.model.input,
                          "ranked_by": "step_time_estimate.step_s_lower_bound, fitting rows first, ties by total",
                          "layouts": [dict(r.estimate.as_dict(), row=i, fits=r.total <= budget,
                                           overrides=row_overrides(r.estimate), **r.extras)
                                      for i, r in enumerate(table, 1)],
                          "fixed_code_saving_per_gpu": saving}))
        return 0 if fitting else 1
    m = cfg.model
    _print_header(args, cfg, facts, estimates, counts.total, gpu_mem)
    _print_rows(args, facts, rows, budget)
    if len(shown) > args.top:
        print(f"  ... {len(shown) - args.top} more (--top N)")
    if not fitting:
        print("no layout fits: turn on train.activation_checkpointing, lower data.seq_len, or add GPUs")
    if saving:
        lay = ref_layout
        verb = "would save" if interface_of(m).has_table else "saves"
        print(f"fixed codes vs a learned {m.vocab_size} x {m.d_model} table {verb}, per GPU of the first "
              f"stage (TP {lay.tp}, DP {lay.dp}, {zname} {_sharding(lay)}): "
              f"{saving['params'] / 1e6:.1f}M params = "
              f"{saving['param_bytes'] / GiB:.3f} GiB params + {saving['grad_bytes'] / GiB:.3f} GiB grads + "
              f"{saving['optimizer_bytes'] / GiB:.3f} GiB optimizer state = {saving['total_bytes'] / GiB:.3f} GiB")
    return 0 if fitting else 1


def _print_header(args, cfg, facts, estimates: list, n_params: int, gpu_mem: float) -> None:
    """What the table is of: the model, the engine's words, the pipeline's and the budget's notes."""
    from ..parallel.memory import RESERVE_BYTES, GiB

    m, seq = cfg.model, cfg.data.seq_len
    print(f"{args.config}: {n_params / 1e9:.3f}B params ({m.n_layers} layers, d {m.d_model}, vocab "
          f"{m.vocab_size}, input={m.input}), seq {seq}, global batch {cfg.train.global_batch}, "
          f"{args.precision}, activation checkpointing {'on' if cfg.train.activation_checkpointing else 'off'}")
    notes = facts.notes
    if notes.intro:
        print(notes.intro)
    if notes.accumulation:  # an engine whose reductions per micro batch are its own
        grad_gb = n_params * (4 if args.precision == "fp32" else 2) / 1e9  # one rank's gradients, compute dtype
        most = max(cfg.train.global_batch // args.gpus, 1)  # micro batch 1 at TP = PP = 1: the most per step
        print(notes.accumulation.format(grad_gb=grad_gb, micro_batches=most, step_gb=grad_gb * most, gpus=args.gpus))
    if any(e.pipeline for e in estimates):  # an engine that sizes its own pipeline (the schedule column)
        print(f"pipeline (pp > 1): parallel.pp_schedule={cfg.parallel.pp_schedule}, parallel.vpp={cfg.parallel.vpp}; "
              f"bubble = idle / busy time per rank replayed from the schedule's own action table (F = I = W = 1, "
              f"B = 2), the closed form (p-1)/(v*m) in brackets; activ holds the microbatches each stage keeps in "
              f"flight in that table")
    print(f"{args.gpus} GPUs x {gpu_mem / GiB:.0f} GiB; fits = total <= that; total = the tensors + a fixed "
          f"reserve of {RESERVE_BYTES / GiB:.0f} GiB (CUDA context, NCCL buffers, fragmentation: what --fake cannot "
          f"see). GiB per GPU on the most loaded stage"
          + notes.grads.get("fp32" if args.precision == "fp32" else "16-bit", "") + ":")


def _print_rows(args, facts, rows: list, budget: float) -> None:
    """The ranked table's note, header and ``rows`` (numbered by their rank among all rows)."""
    from ..parallel.memory import GiB

    zname, zw = facts.column[:2]
    print(f"rows ranked by step>=s, the step-time lower bound (the fitting rows, fastest first; equal bounds: less "
          f"memory first; rows it cannot judge after them): dense matmuls at the {args.gpu_type} peak (pipeline "
          f"bubble included) plus TP's collectives and CP's all-to-alls (they sit between dependent matmuls), "
          f"against all collectives at the links' data-sheet bandwidth ({args.gpus_per_node} GPUs a node, "
          f"{args.inter} between nodes), the "
          f"rest overlapped; it leaves out kernel efficiency, latency, memory-bound kernels and the optimizer "
          f"step. `--pick K` prints row K's overrides")
    print(f"  {'#':>3} {'TP':>3} {'CP':>3} {'PP':>3} {'DP':>4} {zname:>{zw}} {'mb':>3} {'SP':>3} {'partition':>10} | "
          f"{'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'reserve':>8} | {'total':>8}  fits |"
          + header(args.fake))
    for r in rows:
        e, lay = r.estimate, r.layout
        partition = (e.pipeline["schedule"] if e.pipeline else lay.partition) if lay.pp > 1 else "-"
        bubble = (f"  bubble {e.pipeline['bubble_fraction']:.3f} ({e.pipeline['bubble_formula']:.3f}), in flight "
                  f"{e.pipeline['in_flight_per_rank']}" if e.pipeline else "")
        print(f"  {r.rank:>3} {lay.tp:>3} {lay.cp:>3} {lay.pp:>3} {lay.dp:>4} {_sharding(lay):>{zw}} "
              f"{lay.micro_batch:>3} {'y' if lay.sequence_parallel else '-':>3} {partition:>10} | "
              f"{e.params / GiB:8.2f} {e.grads / GiB:8.2f} {e.optimizer / GiB:8.2f} {e.activations / GiB:8.2f} "
              f"{e.reserve / GiB:8.2f} | "
              f"{e.total / GiB:8.2f}  "
              f"{'yes' if e.total <= budget else 'no':>4} |" + columns(r.extras) + bubble
              + row_note(r.extras))


def columns(x: dict) -> str:
    """The table's extra columns for one row (``plan.bound.row_extras``)."""
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
