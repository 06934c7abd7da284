"""``megafixed submit CONFIG --nodes N --gpus-per-node G [...] [overrides]``: a Slurm training job.

Checks the config, the data paths and the layout for N x G ranks here (a mistake fails now, not
after hours in the queue), renders ``megafixed/launch/templates/job.sbatch``, saves it as
``<run_dir>/slurm/job-<time>.sbatch``, calls ``sbatch`` and prints the job id(s). Every submitted
job is appended to ``<run_dir>/slurm/jobs.jsonl`` (id, nodes, script and its hash, git revision).
``--dry-run`` prints the script and touches nothing. ``--chain K`` submits K jobs, each starting
after the previous one ends (``--dependency=afterany``), for runs longer than a partition's time
limit; each resumes from ``checkpoints/latest``.
"""
from __future__ import annotations

import datetime as _dt
import os
import re
import sys

from .. import exit_codes
from ..config import load_config
from ..plural import count
from ..run.run_dir import RunDirectory

HELP = "submit a (multi-node) Slurm training job: sbatch script, pre-timeout checkpoint, requeue"


def add_arguments(p):
    p.add_argument("config", metavar="CONFIG", help="a YAML run config (examples/configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, passed on to `megafixed train`")
    p.add_argument("--nodes", default="1", metavar="N|MIN-MAX",
                   help="nodes (default 1); MIN-MAX (Slurm's syntax) lets a requeued job come back on fewer nodes "
                        "when one is lost: it resumes with fewer data-parallel replicas and the same global batch")
    p.add_argument("--gpus-per-node", type=int, required=True,
                   help="GPUs per node = ranks per node (one srun task per GPU)")
    p.add_argument("--cpu", action="store_true",
                   help="request no GPUs: the ranks run on CPUs (gloo); for CPU clusters and tests")
    p.add_argument("--cpus-per-task", type=int, default=8, help="CPUs per rank (default 8)")
    p.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's default)")
    p.add_argument("--account", default=None, help="Slurm account to charge")
    p.add_argument("--qos", default=None, help="Slurm quality of service")
    p.add_argument("--time", default=None, help="time limit, HH:MM:SS or D-HH:MM:SS (default: the partition's)")
    p.add_argument("--signal-before", type=int, default=300, metavar="SECONDS",
                   help="send the pre-timeout USR1 this long before the time limit: time to finish a step and "
                        "write a checkpoint (default 300)")
    p.add_argument("--no-requeue", action="store_true",
                   help="after a pre-timeout stop, end the job instead of requeueing it")
    p.add_argument("--chain", type=int, default=1, metavar="K",
                   help="submit K jobs, each after the previous ends (--dependency=afterany); default 1")
    p.add_argument("--job-name", default=None, help="Slurm job name (default: the run dir's name)")
    p.add_argument("--dry-run", action="store_true", help="print the job script; submit and write nothing")
    p.add_argument("--layout", choices=["best"], default=None,
                   help="best: run the first row of `megafixed plan` for these GPUs (its TP, PP, sharding and micro "
                        "batch as overrides; the job record names the plan that chose it)")
    p.add_argument("--overwrite", action="store_true",
                   help="with --layout best: replace the run directory's plan_choice.json when it names another "
                        "row; without: remove it")
    p.add_argument("--gpu-mem", default="80GiB", help="with --layout best: memory per GPU (default 80GiB)")
    p.add_argument("--gpu-type", default="H100 80GB HBM3",
                   help="with --layout best: the GPU the plan's step-time bound is for (default H100 80GB HBM3)")
    p.add_argument("--inter", default="ib-ndr400",
                   help="with --layout best: the link between nodes (default ib-ndr400)")


def run(args) -> int:
    from ..launch.sbatch import JobSpec, record, render, sbatch
    from ..launch.slurm_values import check_options
    from ..launch.world import LaunchError

    check_options(LaunchError, partition=args.partition, account=args.account, qos=args.qos, time=args.time,
                  job_name=args.job_name)  # before anything is built: a wrapper's bad value fails at once
    min_nodes, args.nodes = parse_nodes(args.nodes)
    for flag, value, low in (("--nodes", min_nodes, 1), ("--gpus-per-node", args.gpus_per_node, 1),
                             ("--cpus-per-task", args.cpus_per_task, 1), ("--chain", args.chain, 1),
                             ("--signal-before", args.signal_before, 0)):
        if value < low:
            raise LaunchError(f"{flag} {value}: must be >= {low}")
    from ..launch.preflight import check_signal_lead

    check_signal_lead(args.signal_before, args.time)
    world = args.nodes * args.gpus_per_node
    choice = None
    if args.layout == "best":  # the plan's first row, as overrides after the given ones
        from ..plan.best import best_layout

        choice = best_layout(args.config, list(args.overrides), world, gpu_mem=args.gpu_mem, gpu_type=args.gpu_type,
                             gpus_per_node=args.gpus_per_node, inter=args.inter)
        args.overrides = [*args.overrides, *choice.overrides]
    cfg = load_config(args.config, args.overrides)
    _check_plan(cfg, world, gpu=not args.cpu, data=not args.dry_run)
    _check_shrinks(cfg, min_nodes, args.nodes, args.gpus_per_node, gpu=not args.cpu)
    run_dir = os.path.abspath(cfg.train.run_dir)
    spec = JobSpec(config=os.path.abspath(args.config), overrides=list(args.overrides), run_dir=run_dir,
                   nodes=args.nodes, min_nodes=min_nodes if min_nodes < args.nodes else None,
                   gpus_per_node=args.gpus_per_node, cpu=args.cpu,
                   cpus_per_task=args.cpus_per_task, partition=args.partition, account=args.account, qos=args.qos,
                   time=args.time, signal_before=args.signal_before,
                   # A chained job must end at its limit: requeued, it would never end, and the job after it
                   # (afterany) would wait until the whole run is done, then start with nothing left to do.
                   requeue=not args.no_requeue and args.chain == 1,
                   job_name=args.job_name or _default_job_name(run_dir),
                   python=sys.executable, workdir=os.getcwd())
    text = render(spec)
    if choice is not None:  # on stderr: stdout stays the script
        print(f"# --layout best: {' '.join(choice.overrides)} (row 1 of the {choice.fitting} rows that fit, step >= "
              + (f"{choice.step_s_lower_bound:.2f} s" if choice.step_s_lower_bound is not None else "not judged")
              + f", {choice.total_gib:.2f} GiB per GPU; {choice.plan})", file=sys.stderr)
    if args.dry_run:
        print(text, end="")
        if args.chain > 1:
            _describe_chain(spec, args.chain)
        return exit_codes.OK
    from ..atomic import atomic_write_text

    _keep_plan_choice(run_dir, choice.as_dict() if choice else None, args.overwrite)
    os.makedirs(spec.log_dir, exist_ok=True)
    script = _new_script_path(spec.log_dir)
    atomic_write_text(script, text)
    previous = None
    for _ in range(args.chain):
        job_id = sbatch(script, dependency=previous)
        record(spec, script, job_id, previous, layout=choice.as_dict() if choice else None)
        print(job_id)
        print(f"submitted job {job_id}" + (f" (after {previous})" if previous else "") +
              f": {count(args.nodes, 'node')} x {count(args.gpus_per_node, 'rank')}; script {script}; log "
              f"{os.path.join(spec.log_dir, job_id + '.out')}", file=sys.stderr)
        previous = job_id
    return exit_codes.OK


def _keep_plan_choice(run_dir: str, chosen, overwrite: bool) -> None:
    """``--layout best``: the chosen row goes to ``<run_dir>/slurm/plan_choice.json``; every rank's trainer reads
    it for the run record (``megafixed.run.plan_choice``). Without it, an earlier choice is removed only with
    ``--overwrite`` (the run may still be laid out that way), and a line says it stays."""
    from ..run import plan_choice

    if chosen is not None:
        plan_choice.write(run_dir, chosen, overwrite=overwrite)
    elif overwrite:
        plan_choice.remove(run_dir)
    elif os.path.exists(plan_choice.path(run_dir)):
        print(f"note: {plan_choice.path(run_dir)} (an earlier `submit --layout best`) stays, and run records keep "
              f"naming that plan row; pass --overwrite to remove it", file=sys.stderr)


def _default_job_name(run_dir: str) -> str:
    """The run dir's name in Slurm's job-name characters (a given --job-name is checked, not changed)."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", os.path.basename(run_dir.rstrip(os.sep))) or "megafixed"


def _check_plan(cfg, world: int, gpu: bool, data: bool) -> None:
    """What `megafixed train --dry-run --world-size N` checks (layout, precision, the DeepSpeed config,
    data paths) and the resume check the job would make at its start against an existing run
    directory. A dry run only warns about missing data: scripts are often written where the shards
    are not (yet)."""
    from ..engine import engine_config
    from ..run_plan import RunPlan
    from ..train.resume import check_run_dir_takes
    from .train import _check_data_paths

    plan = RunPlan.build(cfg, world, gpu=gpu)  # what each rank of the job will build at its start
    engine_config(cfg, plan)
    check_run_dir_takes(cfg, plan)
    try:
        _check_data_paths(cfg)
    except ValueError as exc:
        if data:
            raise
        print(f"warning: {exc}", file=sys.stderr)


def parse_nodes(text) -> tuple[int, int]:
    """``--nodes N`` or ``MIN-MAX`` -> (min, max)."""
    from ..launch.world import LaunchError

    low, dash, high = str(text).partition("-")
    try:
        a, b = int(low), int(high) if dash else int(low)
    except ValueError:
        raise LaunchError(f"--nodes {text!r}: give a number of nodes, or MIN-MAX (e.g. 2-3) to let a requeued job "
                          f"come back on fewer") from None
    if b < a:
        raise LaunchError(f"--nodes {text}: MIN must not exceed MAX")
    return a, b


def _check_shrinks(cfg, low: int, high: int, per_node: int, gpu: bool) -> None:
    """Every node count the job may come back on must run this layout: a shrink re-lays out only the
    data-parallel degree (the global batch kept by accumulating more); a TP or PP group that would lose
    its node is refused here, by name, not hours later in the queue."""
    from ..launch.world import LaunchError
    from ..run_plan import RunPlan

    for nodes in range(high - 1, low - 1, -1):
        try:
            RunPlan.build(cfg, nodes * per_node, gpu=gpu)
        except ValueError as exc:
            raise LaunchError(f"--nodes {low}-{high}: on {nodes} node(s) ({nodes * per_node} ranks) this run cannot "
                              f"go on ({exc}); a job may shrink only by whole data-parallel replicas (tensor- and "
                              f"pipeline-parallel groups stay whole): raise the minimum to {nodes + 1}") from None


def _describe_chain(spec, k: int) -> None:
    """What `--chain K` would submit: one script, K sbatch calls, each after the one before (to stderr,
    so that stdout stays the script itself)."""
    import shlex

    from ..launch.sbatch import sbatch_command

    script = os.path.join(spec.log_dir, "job-<time>.sbatch")
    print(f"# --chain {k}: {k} jobs run this script one after another, each resuming from "
          f"{RunDirectory(spec.run_dir).latest_file}; requeue is off (a chained job ends at its time "
          f"limit and the next one continues)", file=sys.stderr)
    for i in range(1, k + 1):
        cmd = sbatch_command(script, f"<job {i - 1}>" if i > 1 else None)
        print(f"#   job {i}: {' '.join(shlex.quote(c) if '<' not in c else c for c in cmd)}", file=sys.stderr)


def _new_script_path(log_dir: str) -> str:
    """A new file per submission: a resubmitted run never overwrites the script an earlier job ran."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path, n = os.path.join(log_dir, f"job-{stamp}.sbatch"), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(log_dir, f"job-{stamp}-{n}.sbatch")
    return path
