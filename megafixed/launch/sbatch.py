"""Render the job script of ``megafixed submit``, submit it, and record submitted jobs in the run dir.

The template (``templates/job.sbatch``) is a readable bash script with ``{{NAME}}`` placeholders:
bash itself uses ``$NAME``/``${NAME}`` and ``#SBATCH --signal=B:USR1@600`` uses ``@``, so the
placeholders use a syntax that appears nowhere in a job script (and ``string.Template`` or
``str.format`` would fight with bash). Rendering refuses a placeholder left unfilled.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Optional

from .slurm_values import check_options, first_problem, path_problem
from .world import LaunchError

_PLACEHOLDER = re.compile(r"{{([A-Z_]+)}}")


@dataclasses.dataclass
class JobSpec:
    config: str  # absolute path of the run config
    overrides: list[str]
    run_dir: str  # absolute
    nodes: int  # the most nodes (the job starts on as many as Slurm gives, between min_nodes and nodes)
    gpus_per_node: int  # ranks per node; GPUs requested unless cpu
    min_nodes: Optional[int] = None  # `--nodes MIN-MAX`: a requeued job may come back on fewer
    cpu: bool = False
    cpus_per_task: int = 8
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: Optional[str] = None
    signal_before: int = 300
    requeue: bool = True
    job_name: str = "megafixed"
    python: str = sys.executable
    workdir: str = os.getcwd()

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def log_dir(self) -> str:
        return os.path.join(self.run_dir, "slurm")


def template_text() -> str:
    return resources.files("megafixed.launch").joinpath("templates/job.sbatch").read_text()


def render(spec: JobSpec, submitted: Optional[str] = None) -> str:
    """The job script for ``spec``: pure text, nothing touched. A value that bash reads is ``shlex.quote``d;
    a value in an ``#SBATCH`` line must be Slurm's to take (``slurm_values``), else one line, exit 2."""
    fix = "choose a path without them (train.run_dir=..., or submit from another directory)"
    problem = first_problem(path_problem("run dir", spec.log_dir, fix), path_problem("working directory",
                                                                                      spec.workdir, fix))
    if problem:
        raise LaunchError(problem)
    check_options(LaunchError, partition=spec.partition, account=spec.account, qos=spec.qos, time=spec.time,
                  job_name=spec.job_name)
    options = []
    if not spec.cpu:
        options.append(f"#SBATCH --gpus-per-node={int(spec.gpus_per_node)}")
    for flag, value in (("time", spec.time), ("partition", spec.partition), ("account", spec.account),
                        ("qos", spec.qos)):
        if value:
            options.append(f"#SBATCH --{flag}={value}")
    ranged = spec.min_nodes is not None and spec.min_nodes < spec.nodes
    values = {
        "NODES": f"{int(spec.min_nodes)}-{int(spec.nodes)}" if ranged else int(spec.nodes),
        "TASKS_PER_NODE": int(spec.gpus_per_node), "PER_NODE": per_node_request(spec, ranged),
        "WORLD": f"{spec.min_nodes * spec.gpus_per_node}-{spec.world}" if ranged else spec.world,
        "CPUS_PER_TASK": int(spec.cpus_per_task),
        "SUBMITTED": " ".join((submitted or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
                              .split()),  # a comment line: no newline may end it
        "JOB_NAME": spec.job_name, "SIGNAL_BEFORE": int(spec.signal_before),
        "LOG_DIR": spec.log_dir, "WORKDIR": spec.workdir, "SBATCH_OPTIONS": "\n".join(options),
        "RUN_DIR": shlex.quote(spec.run_dir),
        "PYTHON": shlex.quote(spec.python), "REQUEUE": int(spec.requeue),
        "TRAIN_ARGS": " ".join(shlex.quote(a) for a in [spec.config, *spec.overrides]),
    }

    def fill(m):
        if m.group(1) not in values:
            raise KeyError(f"job.sbatch placeholder {{{{{m.group(1)}}}}} has no value")  # a template bug
        return str(values[m.group(1)])

    text = _PLACEHOLDER.sub(fill, template_text())
    return re.sub(r"\n{3,}", "\n\n", text)  # no double blank line where the options were empty


def per_node_request(spec: JobSpec, ranged: bool) -> str:
    """The #SBATCH lines that size each node's share of the job.

    A fixed node count asks for ``--ntasks-per-node``. A range must not: sbatch (seen with Slurm 22.05)
    turns ``--ntasks-per-node=G`` into ``--ntasks=MIN x G`` when no task count is given, and a job of
    MIN x G tasks at G per node never gets more than MIN nodes, however many are free. A range asks for
    each node's CPUs instead (``--mincpus``; the GPUs come from ``--gpus-per-node``), and the script's
    srun starts G ranks on every node the job got."""
    if not ranged:
        return f"#SBATCH --ntasks-per-node={spec.gpus_per_node}"
    return ("# No --ntasks-per-node with a node range: sbatch would set --ntasks=MIN x it, capping the job at MIN "
            "nodes.\n# Each node's CPUs instead (its ranks x --cpus-per-task); srun below starts the ranks.\n"
            f"#SBATCH --mincpus={spec.gpus_per_node * spec.cpus_per_task}")


def git_revision(path: str | os.PathLike | None = None) -> Optional[str]:
    """The code's commit (``+dirty`` with uncommitted changes), or None outside a git checkout."""
    path = path or Path(__file__).resolve().parent
    if shutil.which("git") is None:
        return None
    try:
        rev = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=60)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def sbatch_command(script: str, dependency: Optional[str] = None) -> list[str]:
    """The sbatch command line of one job (``submit --dry-run`` prints it for every job of a chain)."""
    return ["sbatch", "--parsable"] + ([f"--dependency=afterany:{dependency}"] if dependency else []) + [script]


def sbatch(script: str, dependency: Optional[str] = None) -> str:
    """Submit ``script``; returns the job id. ``dependency``: a job id this one starts after (afterany)."""
    if shutil.which("sbatch") is None:
        raise LaunchError("sbatch is not on PATH: run `megafixed submit` on a Slurm login node (or use --dry-run "
                          "to print the script)")
    out = subprocess.run(sbatch_command(script, dependency), capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise LaunchError(f"sbatch refused the job ({out.stderr.strip() or out.stdout.strip()}); the script is "
                          f"{script}")
    return out.stdout.strip().split(";")[0]  # "id" or "id;cluster"


def record(spec: JobSpec, script: str, job_id: str, dependency: Optional[str], layout: Optional[dict] = None) -> dict:
    """Append the submitted job to ``<run_dir>/slurm/jobs.jsonl`` (one JSON object per line); ``layout``:
    the plan row ``submit --layout best`` chose, and the plan that chose it."""
    entry = {"job_id": job_id, "submitted": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
             "nodes": spec.nodes, "min_nodes": spec.min_nodes, "ranks_per_node": spec.gpus_per_node,
             "world": spec.world,
             "gpus": not spec.cpu, "after": dependency, "script": script,
             "script_sha256": hashlib.sha256(Path(script).read_bytes()).hexdigest(),
             "git_revision": git_revision(), "config": spec.config, "overrides": spec.overrides}
    if layout is not None:
        entry["layout_chosen_by_plan"] = layout
    with open(os.path.join(spec.log_dir, "jobs.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry
