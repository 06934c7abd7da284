"""``megafixed train CONFIG [overrides]``: train or resume a run (DeepSpeed, or ``train.engine=torch``).

Works as a plain process (one rank), under ``torchrun --nproc-per-node N`` or the ``deepspeed``
launcher. Running the same command again resumes from ``<run_dir>/checkpoints/latest``.
``--dry-run`` validates everything (layout included, for ``--world-size`` ranks) and prints the
resolved config and the engine's config (DeepSpeed's JSON, or the torch engine's record) without
starting anything -- on a CPU login node it plans the GPU run (bf16, NCCL).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import NoReturn

from .. import exit_codes
from ..config import load_config
from ..plural import count

HELP = "train a model (single process, torchrun or the deepspeed launcher); rerunning resumes"


def add_arguments(p):
    p.add_argument("config", metavar="CONFIG", help="a YAML run config (examples/configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.max_steps=100")
    p.add_argument("--dry-run", action="store_true",
                   help="validate config, data paths and layout; print the resolved config and the engine's config")
    p.add_argument("--world-size", type=int, default=None,
                   help="with --dry-run: the number of ranks to plan for (default: this launch's)")
    p.add_argument("--target", choices=["gpu", "cpu"], default="gpu",
                   help="with --dry-run: the machine the run is for (default: gpu; auto precision -> bf16)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help=argparse.SUPPRESS)  # passed by the deepspeed launcher; we read LOCAL_RANK


def run(args) -> int:
    from ..errors import report

    if args.dry_run:
        try:
            return dry_run(args)
        except Exception as exc:  # noqa: BLE001 -- the error boundary decides what is a bug
            return report(exc)
    from ..train.stop import StopRequest

    code, stop = exit_codes.OK, StopRequest()
    try:
        code = _train(args, stop)
    except Exception as exc:  # noqa: BLE001
        from ..launch.refusal import give_rank0_the_lead

        code = report(exc)
        # rank 0's line must be out before the launcher ends the job (a TERM already caught: it has)
        give_rank0_the_lead(exc, code, ended_already=lambda: stop.requested)
    _flush_and_exit(code)


def _train(args, stop) -> int:
    # SIGUSR1 (Slurm's pre-timeout signal, which the job script forwards) and SIGTERM (scancel, preemption,
    # the time limit itself): finish the step (or leave validation), save, exit STOPPED. Installed before
    # the rendezvous and data preparation, so that a signal during start-up becomes a clean stop instead
    # of the default action (death without a checkpoint). Requeueing is the job script's decision (it
    # sees exit 75 and knows whether the signal was the pre-timeout one): see megafixed/launch.
    # Ctrl-C (SIGINT) is the same request from a keyboard; a second one aborts (train/stop.py).
    stop.install_signal_handlers((signal.SIGUSR1, signal.SIGTERM), interrupt=True)
    cfg = load_config(args.config, args.overrides)
    from ..engine import prepare_runtime_env

    # the run's engine's, before anything imports its library; gloo keeps DeepSpeed on CPU on a GPU host
    prepare_runtime_env(cfg.train.engine, cfg.parallel.backend)
    # torch comes in with the plan, after the config: a refusal of the config answers without it
    from ..data.prepare import prepare_data
    from ..parallel import setup_distributed
    from ..run_plan import RunPlan
    from ..train.callbacks import build_callbacks
    from ..train.trainer import train

    plan = RunPlan.for_launch(cfg)  # the layout, validated once, before any process group exists
    build_callbacks(cfg, [])  # a callback that cannot run on this layout is refused here, on every rank alike
    topo = setup_distributed(plan)  # the one Topology of this process; topo.plan is the plan
    cfg = prepare_data(cfg, is_main=topo.is_main)  # fills in data paths only: nothing the plan read
    _barrier()  # other ranks read the shards rank 0 may just have written
    try:
        result = train(cfg, topo, stop=stop)
    except Exception as exc:  # noqa: BLE001 -- a dead peer becomes one line naming it; anything else re-raises
        from ..launch.lost import lost_peer_error

        lost = lost_peer_error(exc, cfg.train.run_dir, cfg.parallel.collective_timeout_s)
        if lost is None:
            raise
        lost.after_start = True  # launch/refusal.py: the survivors do not wait for rank 0's line
        for note in getattr(exc, "__notes__", ()):  # e.g. where the run's files are kept
            lost.add_note(note)
        raise lost from exc
    if topo.is_main:
        from ..run.run_dir import RunDirectory

        rd = RunDirectory(result.run_dir)
        ckpt = os.path.join(rd.checkpoints, result.checkpoint or "")
        print(f"{'stopped' if result.stopped else 'done'}: {count(result.step, 'step')}; metrics "
              f"{rd.metrics_file}, checkpoint {ckpt}")
    if result.leaving:  # transient faults on a node: saved; the job script resubmits without it
        return exit_codes.EXCLUDE_NODE
    if result.stopped and stop.interrupted:
        return exit_codes.INTERRUPTED
    return exit_codes.STOPPED if result.stopped else exit_codes.OK


def dry_run(args) -> int:
    import yaml

    from ..config import resolve_code
    from ..engine import engine_config
    from ..engines import kind_of
    from ..parallel.topology import launch_world
    from ..run_plan import RunPlan
    from ..train.callbacks import build_callbacks

    cfg = load_config(args.config, args.overrides)
    world = args.world_size or launch_world()[0]
    plan = RunPlan.build(cfg, world, gpu=args.target == "gpu")  # what the real run will build
    build_callbacks(cfg, [])  # what the real run would refuse when it builds its callbacks
    try:
        _check_data_paths(cfg)
    except ValueError as exc:
        # Planning a cluster run on a laptop or login node: the shards live where the run will start.
        print(f"warning: {exc} (a dry run plans anyway; the shards must exist where the run starts)",
              file=sys.stderr)
    record = engine_config(cfg, plan)
    print("# resolved config")
    print(yaml.safe_dump(resolve_code(cfg).to_dict(), sort_keys=False).rstrip())
    kind = kind_of(plan)
    facts = kind.facts
    print(f"# {facts.config_title} config (written to <run_dir>/{facts.record_file} by a real run)")
    print(json.dumps(record, indent=2))
    sharding = facts.dry_run_words.format(**record, plan=plan.engine_plan)  # the engine's words: its record, its plan
    for line in kind.dry_run_lines(cfg, plan):  # e.g. a pipeline's bubble
        print(line)
    if plan.cp > 1:
        print(_context_parallel_line(plan, cfg.data.seq_len))
    print(f"# plan: {plan.describe()}; {plan.precision} on {args.target}, backend {plan.backend}; "
          f"{sharding}. Nothing was started.")
    return exit_codes.OK


def _context_parallel_line(plan, seq: int) -> str:
    """--dry-run's words for context parallelism: how each sequence is split, and by what."""
    cp = plan.cp
    how = ("Ulysses: attention on whole sequences for 1/cp of the heads, four all-to-alls per layer"
           if plan.cp_method == "ulysses" else "ring attention: key/value blocks passed round the cp ranks")
    return (f"# context parallel: cp {cp} ({plan.cp_method}), each sequence of {seq} tokens split into {cp} "
            f"slices of {seq // cp} ({how}); gradients reduced over dp x cp = {plan.dp * cp} ranks")


def _check_data_paths(cfg) -> None:
    """Shards must exist unless the run will tokenize ``data.source`` itself or trains on ``data.mock``."""
    from ..data.errors import DataError
    from ..data.prefixes import resolve_prefix

    if cfg.data.source or cfg.data.mock:
        return
    if not cfg.data.prefixes:
        raise DataError("no data: set data.prefixes (preprocessed shards), data.source (a raw corpus) or "
                        "data.mock=true (synthetic tokens)")
    for prefix in cfg.data.prefixes:
        try:
            resolve_prefix(prefix)
        except DataError as exc:
            raise DataError(f"{exc}; or data.mock=true to run on synthetic tokens without shards") from None


def _barrier() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()


def _flush_and_exit(code: int) -> NoReturn:
    """Leave without running DeepSpeed's atexit teardown, which has been seen to SIGABRT after a
    finished run; everything we own (metrics, checkpoints, `latest`) is already flushed and closed."""
    from ..launch.warnings_once import flush

    flush()  # rank 0: the library warnings not yet printed, once each with their rank counts
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
