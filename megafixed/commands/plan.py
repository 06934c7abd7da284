"""``megafixed plan CONFIG --gpus N [--gpu-mem 80GB] [--json]``: which layouts fit, and why.

Lists every feasible (TP, PP, DP, ZeRO, micro-batch[, SP]) layout for N GPUs with its estimated
memory per GPU (parameters, gradients, optimizer state, activations; ``megafixed.parallel.memory``
documents the formulas), marks the ones that fit, and shows what the fixed codes save versus a
learned table of the same shape.
"""
from __future__ import annotations

import json
import re

from ..config import ConfigError, load_config

HELP = "list feasible TP/PP/DP/ZeRO layouts and their estimated memory per GPU"



def parse_bytes(text: str) -> float:
    # one number (digits with at most one dot), then an optional unit: "1.2.3GB" is refused here
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"--gpu-mem {text!r} must be a positive size like 80GB, 40GiB or 24G")
    # SI as the data sheets write it (80GB = 80e9 bytes); KiB/MiB/GiB/TiB are powers of 1,024
    unit = (m.group(2) or "GB").upper().rstrip("B")
    binary = unit.endswith("I")
    power = " KMGT".index(unit.rstrip("I") or " ")
    return float(m.group(1)) * (1024 if binary else 1000) ** power


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
    from .plan_fake import add_arguments as fake_arguments

    fake_arguments(p)  # --fake, and the GPU and links of the step-time bound


def _sharding(lay) -> str:
    """The ZeRO column: the stage, or under FSDP2 the HSDP degrees (replicate x shard): its engine's words."""
    return lay.planner.sharding_text(lay)


def run(args) -> int:
    from ..engine import prepare_runtime_env

    cfg = load_config(args.config, args.overrides)  # a ConfigError is reported by cli.main
    # the run's engine's environment only (DeepSpeed's partitioner sizes its pipeline rows: quiet,
    # CPU-safe); the torch engine's plan touches nothing of DeepSpeed's
    prepare_runtime_env(cfg.train.engine)
    from ..model.interfaces import interface_of
    from ..parallel.memory import GiB, fixed_code_saving, tp_param_counts

    gpu_mem = parse_bytes(args.gpu_mem)
    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: the number of GPUs to plan for must be >= 1")
    budget = gpu_mem  # the room for the CUDA context, NCCL and fragmentation is each row's reserve
    from ..engines import engine_kind

    planner = engine_kind(cfg.train.engine).planner  # the engine's sharding arithmetic and column
    zname, zw = planner.COLUMN
    from .plan_fake import add_fake, measure_rows
    from .plan_rank import config_precision, overrides_of, pick

    estimates, extras = plan_rows(cfg, args.gpus, budget, args.precision, args)  # in rank order (plan_rank)
    if args.pick is not None:
        print(" ".join(pick(estimates, budget, args.pick, cfg, args.precision, GiB)))
        return 0
    fitting = [e for e in estimates if e.total <= budget]
    counts = tp_param_counts(cfg.model)
    ref_layout = (fitting or estimates)[0].layout if estimates else None
    saving = fixed_code_saving(cfg.model, ref_layout, args.precision) if ref_layout else None

    shown = estimates if args.all else fitting
    rows = shown[:args.top]
    if args.fake:
        for e, fake in zip(rows, measure_rows(args, planner, rows)):
            add_fake(extras[id(e)], fake)
    resolved = config_precision(cfg)

    def row_overrides(e):
        return overrides_of(e.layout, args.precision, resolved)

    if args.json:
        print(json.dumps({"config": args.config, "engine": cfg.train.engine, "gpus": args.gpus,
                          "gpu_mem_bytes": gpu_mem,
                          "budget_bytes": budget, "precision": args.precision,
                          "params_total": counts.total, "input": cfg.model.input,
                          "ranked_by": "step_time_estimate.step_s_lower_bound, fitting rows first, ties by total",
                          "layouts": [dict(e.as_dict(), row=i, fits=e.total <= budget, overrides=row_overrides(e),
                                           **extras[id(e)]) for i, e in enumerate(estimates, 1)],
                          "fixed_code_saving_per_gpu": saving}))
        return 0 if fitting else 1
    m = cfg.model
    _print_header(args, cfg, planner, estimates, counts.total, gpu_mem)
    _print_rows(args, planner, estimates, rows, extras, budget)
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


def _print_header(args, cfg, planner, estimates: list, n_params: int, gpu_mem: float) -> None:
    """What the table is of: the model, the engine's words, the pipeline's and the budget's notes."""
    from ..parallel.memory import RESERVE_BYTES, GiB

    m, seq = cfg.model, cfg.data.seq_len
    print(f"{args.config}: {n_params / 1e9:.3f}B params ({m.n_layers} layers, d {m.d_model}, vocab "
          f"{m.vocab_size}, input={m.input}), seq {seq}, global batch {cfg.train.global_batch}, "
          f"{args.precision}, activation checkpointing {'on' if cfg.train.activation_checkpointing else 'off'}")
    if planner.intro(args.precision):
        print(planner.intro(args.precision))
    note = planner.accumulation_note(m, args.gpus, cfg.train.global_batch, args.precision)
    if note:  # an engine whose reductions per micro batch are its own
        print(note)
    if any(e.pipeline for e in estimates):  # an engine that sizes its own pipeline (the schedule column)
        print(f"pipeline (pp > 1): parallel.pp_schedule={cfg.parallel.pp_schedule}, parallel.vpp={cfg.parallel.vpp}; "
              f"bubble = idle / busy time per rank replayed from the schedule's own action table (F = I = W = 1, "
              f"B = 2), the closed form (p-1)/(v*m) in brackets; activ holds the microbatches each stage keeps in "
              f"flight in that table")
    print(f"{args.gpus} GPUs x {gpu_mem / GiB:.0f} GiB; fits = total <= that; total = the tensors + a fixed "
          f"reserve of {RESERVE_BYTES / GiB:.0f} GiB (CUDA context, NCCL buffers, fragmentation: what --fake cannot "
          f"see). GiB per GPU on the most loaded stage"
          + planner.grads_note(args.precision) + ":")


def _print_rows(args, planner, estimates: list, rows: list, extras: dict, budget: float) -> None:
    """The ranked table's note, header and ``rows`` (numbered by their rank among ``estimates``)."""
    from ..parallel.memory import GiB
    from .plan_fake import columns, header, row_note

    zname, zw = planner.COLUMN
    print(f"rows ranked by step>=s, the step-time lower bound (the fitting rows, fastest first; equal bounds: less "
          f"memory first; rows it cannot judge after them): dense matmuls at the {args.gpu_type} peak (pipeline "
          f"bubble included) plus TP's collectives (they sit between dependent matmuls), against all collectives at "
          f"the links' data-sheet bandwidth ({args.gpus_per_node} GPUs a node, {args.inter} between nodes), the "
          f"rest overlapped; it leaves out kernel efficiency, latency, memory-bound kernels and the optimizer "
          f"step. `--pick K` prints row K's overrides")
    print(f"  {'#':>3} {'TP':>3} {'PP':>3} {'DP':>4} {zname:>{zw}} {'mb':>3} {'SP':>3} {'partition':>10} | "
          f"{'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'reserve':>8} | {'total':>8}  fits |"
          + header(args.fake))
    number = {id(e): i for i, e in enumerate(estimates, 1)}
    for e in rows:
        lay = e.layout
        partition = (e.pipeline["schedule"] if e.pipeline else lay.partition) if lay.pp > 1 else "-"
        bubble = (f"  bubble {e.pipeline['bubble_fraction']:.3f} ({e.pipeline['bubble_formula']:.3f}), in flight "
                  f"{e.pipeline['in_flight_per_rank']}" if e.pipeline else "")
        print(f"  {number[id(e)]:>3} {lay.tp:>3} {lay.pp:>3} {lay.dp:>4} {_sharding(lay):>{zw}} {lay.micro_batch:>3} "
              f"{'y' if lay.sequence_parallel else '-':>3} {partition:>10} | {e.params / GiB:8.2f} "
              f"{e.grads / GiB:8.2f} {e.optimizer / GiB:8.2f} {e.activations / GiB:8.2f} {e.reserve / GiB:8.2f} | "
              f"{e.total / GiB:8.2f}  "
              f"{'yes' if e.total <= budget else 'no':>4} |" + columns(extras[id(e)]) + bubble
              + row_note(extras[id(e)]))


def plan_rows(cfg, gpus: int, budget: float, precision: str, links) -> tuple[list, dict]:
    """(every layout's estimate in rank order, {id(estimate): its row extras}): what the table lists."""
    from ..parallel.memory import estimate
    from .plan_fake import row_extras
    from .plan_rank import ranked

    estimates = [estimate(cfg.model, cfg.data.seq_len, lay, precision)
                 for lay in feasible_layouts(cfg, gpus, precision=precision)]
    extras = {id(e): row_extras(cfg, e, links, None, precision) for e in estimates}
    return ranked(estimates, extras, budget), extras


def feasible_layouts(cfg, gpus: int, max_tp: int = 8, precision: str | None = None) -> list:
    """Every (tp, pp, dp, zero, micro, sp) whose run plan builds, for ``gpus`` GPUs in ``precision``
    (None: the config's ``train.precision``, resolved for a GPU). Here, above the run plan, rather
    than in ``parallel.memory`` (which the run plan's layer sits on)."""
    from ..engines import engine_kind

    planner = engine_kind(cfg.train.engine).planner
    out = []
    tps = [t for t in (1, 2, 4, 8, 16) if t <= min(gpus, max_tp)]
    for tp in tps:
        for pp in planner.pp_degrees(gpus, tp):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for option in planner.sharding_options(dp):  # ZeRO stages; HSDP replicate degrees
                for micro in (1, 2, 4, 8, 16, 32):
                    if micro * dp > cfg.train.global_batch:
                        continue
                    for sp in ((False, True) if tp > 1 else (False,)):
                        if _builds(cfg, planner, gpus, tp, pp, option, micro, sp, precision):
                            for part in planner.pp_partitions(pp):  # the engine's pipeline splits to compare
                                out.append(planner.make_layout(cfg, tp, pp, dp, option, micro, sp, part))
    return out


def _builds(cfg, planner, gpus, tp, pp, option, micro, sp, precision) -> bool:
    """Whether the run plan of this variant of ``cfg`` builds (its layout rules and engine's refusals)."""
    import copy

    from ..parallel.layout import LayoutError
    from ..run_plan import RunPlan

    c = copy.deepcopy(cfg)
    c.parallel.tp, c.parallel.pp = tp, pp
    if pp == 1:  # the config's pipeline schedule is for its pp > 1 rows; a run at pp 1 refuses one
        c.parallel.pp_schedule, c.parallel.vpp = "1F1B", 1
    planner.set_sharding(c, option)
    c.parallel.sequence_parallel, c.train.micro_batch = sp, micro
    c.train.precision = precision or c.train.precision
    c.parallel.backend = "auto"  # GPU memory is what is sized, whatever the config's backend
    try:
        RunPlan.build(c, gpus, gpu=True)
    except LayoutError:
        return False
    return True
