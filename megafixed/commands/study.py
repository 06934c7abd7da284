"""``megafixed study CONFIG --interfaces learned,canonical,gf2 --seeds 0,1,2 [--grid KEY=V1,V2 ...]``.

Trains every grid point x interface x seed with the same recipe and data order, evaluates each
run, and writes ``OUT/report.md`` with tables over seeds, paired differences and curves. Rerunning
the same command skips finished runs and resumes interrupted ones.
"""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from .. import exit_codes

HELP = "the interface study: train learned/canonical/gf2 x seeds (x a grid), evaluate, write report.md"


def add_arguments(p):
    p.add_argument("config", help="base run config (every run uses it plus the overrides)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides applied to every run")
    p.add_argument("--interfaces", default="learned,canonical,gf2", help="model.input values (default: all three)")
    p.add_argument("--seeds", default="0,1", help="train.seed values, one run each (default: 0,1)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="also vary a config key, e.g. model.n_layers=2,4 (repeatable)")
    p.add_argument("--out", default="runs/study", help="study directory (default: runs/study)")
    p.add_argument("--eval-tasks", default="hellaswag,piqa,lambada",
                   help="zero-shot tasks scored for each run (megafixed eval); '' for none")
    p.add_argument("--eval-limit", type=int, default=200, help="items per task (default 200; 0 = all)")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their status; train nothing")
    p.add_argument("--submit", action="store_true",
                   help="submit each unfinished run as a Slurm job (`megafixed submit`) instead of training here; "
                        "rerun the study without --submit once they finished to evaluate them and write the report")
    p.add_argument("--submit-args", default="--gpus-per-node 1", metavar="'FLAGS'",
                   help="flags for `megafixed submit`, e.g. '--nodes 1 --gpus-per-node 8 --time 04:00:00'")


def run(args) -> int:
    from ..config import ConfigError
    from ..engine import prepare_runtime_env
    from ..study.plan import parse_grid, parse_list, plan_runs
    from ..study.report import write_report
    from ..study.runner import StudyStopped, is_finished, run_config, run_study

    prepare_runtime_env()
    out = Path(args.out).resolve()
    interfaces = parse_list(args.interfaces, "--interfaces")
    seeds = parse_list(args.seeds, "--seeds", int)
    grid = parse_grid(args.grid)
    runs = plan_runs(out, interfaces, seeds, grid)
    if args.eval_tasks:
        from ..eval.tasks import parse_tasks
        parse_tasks(args.eval_tasks)  # an unknown task fails now, not after hours of training
    if args.eval_limit < 0:
        raise ConfigError(f"--eval-limit {args.eval_limit} must be >= 0 (0 = every item)")
    configs = [run_config(args.config, args.overrides, r) for r in runs]  # every config is valid before we start
    if not args.submit:  # (`megafixed submit` plans each of its jobs itself)
        _check_plans(configs, gpu=True if args.dry_run else None)
    _claim_study_dir(out, args, grid)
    if not args.dry_run and not args.submit:
        from ..plotting import INSTALL, have_matplotlib

        if not have_matplotlib():
            print(f"note: matplotlib is not installed, so report.md gets its tables but no PNG curves ({INSTALL})")
    if args.submit:
        return _submit(args, runs, configs)
    if args.dry_run:
        for r, cfg in zip(runs, configs):
            state = "finished" if is_finished(r, cfg.train.max_steps) else "to train"
            print(f"{r.point_name:24s} {r.interface:10s} seed {r.seed:<4d} {state:9s} {r.run_dir}")
        return exit_codes.OK
    from ..train.stop import StopRequest

    stop = StopRequest()
    stop.install_signal_handlers()  # SIGUSR1: the current run saves and the study stops; rerun resumes
    try:
        results = run_study(args.config, args.overrides, runs, stop=stop, tasks=args.eval_tasks,
                            limit=args.eval_limit)
    except StudyStopped as exc:
        print(f"stopped: {exc}")
        return exit_codes.STOPPED
    command = "megafixed study " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 2 else ""
    report = write_report(out, results, command or f"megafixed study {args.config}")
    print(f"report: {report}")
    return exit_codes.OK


def _check_plans(configs, gpu) -> None:
    """Every run's plan for this launch (its layout, and what its engine -- ``train.engine`` -- refuses by
    name, e.g. parallel.pp=2 with train.engine=torch) before the first run trains; a dry run plans for
    GPUs, as ``train --dry-run`` does."""
    from ..parallel.topology import launch_world
    from ..run_plan import RunPlan

    world = launch_world()[0]
    for cfg in configs:
        RunPlan.build(cfg, world, gpu=gpu)


def _submit(args, runs, configs) -> int:
    """One `megafixed submit` per unfinished run (each a resumable Slurm job with its own run dir)."""
    from ..cli import main as cli_main
    from ..study.runner import is_finished

    extra = shlex.split(args.submit_args)
    for r, cfg in zip(runs, configs):
        if is_finished(r, cfg.train.max_steps):
            print(f"{r.point_name} {r.interface} seed {r.seed}: finished earlier, not submitted")
            continue
        code = cli_main(["submit", args.config or "/dev/null", *args.overrides, *r.overrides, *extra])
        if code != exit_codes.OK:
            return code
    print("when the jobs have finished, rerun this command without --submit: finished runs are skipped, and "
          "it evaluates them and writes report.md")
    return exit_codes.OK


def _claim_study_dir(out: Path, args, grid) -> None:
    """A study directory belongs to one base config: rerunning extends or resumes it, but a study
    of another config, overrides or grid must not mix its runs into it."""
    from ..atomic import atomic_write_text
    from ..config import ConfigError

    spec = json.loads(json.dumps({"config": str(Path(args.config).resolve()) if args.config else None,
                                  "overrides": list(args.overrides), "grid": grid}))
    path = out / "study.json"
    if path.exists():
        if json.loads(path.read_text()) != spec:
            raise ConfigError(f"{out} holds a study of another config, overrides or grid ({path}); rerun with the "
                              f"same ones to resume it, or choose another --out")
        return
    if not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(spec, indent=1))
