"""``megafixed preprocess ... --submit``: a Slurm job array over input-file groups, then a manifest job.

    megafixed preprocess --input 'corpus/*.jsonl.zst' --tokenizer tok.json --output-prefix data/c \\
        --submit --nodes 64 --partition cpu --time 04:00:00 [--dry-run]

writes ``data/c.plan.json`` (the groups: contiguous runs of input files balanced by bytes) and two
scripts under ``data/c.slurm/``: an array (one task per group not yet done, at most ``--nodes`` at
once, each writing ``data/c_gNNNNN``) and a manifest job that starts after the whole array (afterany)
and writes ``data/c.manifest.json``, or refuses naming every missing group. Train on it with
``data.prefixes=[data/c.manifest.json]``. Rerunning the same command redoes only the missing
groups; ``--overwrite`` redoes everything. ``--dry-run`` prints the plan and scripts, writes nothing.

The tasks run ``python -m megafixed.commands.preprocess_submit group PLAN INDEX`` (and ``manifest
PLAN``): the plan holds every option, so what a task does is fixed when the job is submitted.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

from ..data import preprocess_groups as pg
from ..data.errors import DataError
from ..launch.slurm_values import check_options, first_problem, path_problem


def add_arguments(p) -> None:
    g = p.add_argument_group("many nodes (Slurm)")
    g.add_argument("--submit", action="store_true",
                   help="run as a Slurm job array over input-file groups plus a manifest job (see --nodes)")
    g.add_argument("--nodes", type=int, default=1, help="array tasks running at once, one node each")
    g.add_argument("--groups", type=int, default=None,
                   help="input-file groups (array tasks); default --nodes. Balanced by bytes, contiguous in order")
    g.add_argument("--partition", default=None)
    g.add_argument("--account", default=None)
    g.add_argument("--time", default=None, help="time limit per array task (HH:MM:SS or D-HH:MM:SS)")
    g.add_argument("--dry-run", action="store_true", help="print the plan and the two job scripts; submit nothing")


def _options(args) -> dict:
    from ..data.readers import DEFAULT_MAX_RECORD_BYTES

    return {"tokenizer": os.path.abspath(args.tokenizer), "json_keys": list(args.json_keys), "workers": args.workers,
            "append_eod": args.append_eod, "shard_size_mb": args.shard_size_mb, "strict": args.strict,
            "text_split": args.text_split, "code_bits": args.code_bits, "batch_records": args.batch_size,
            "chunk_mb": args.chunk_mb, "backend": args.backend, "verify_chars": args.verify_chars,
            "max_record_bytes": args.max_record_bytes or DEFAULT_MAX_RECORD_BYTES}


def _header(name: str, log: str, args, extra: list[str]) -> list[str]:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", "#SBATCH --nodes=1", "#SBATCH --ntasks=1",
             f"#SBATCH --output={log}", *extra]
    for flag, value in (("partition", args.partition), ("account", args.account), ("time", args.time)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    return lines


def render(args, plan_file: str, todo: list[int], slurm_dir: str) -> tuple[str, str]:
    """(array script, manifest script) as text."""
    py = f"{shlex.quote(sys.executable)} -m megafixed.commands.preprocess_submit"
    cd = f"cd {shlex.quote(os.getcwd())}"
    array = _header("megafixed-preprocess", f"{slurm_dir}/group_%a.out", args,
                    [f"#SBATCH --array={','.join(map(str, todo))}%{args.nodes}",
                     f"#SBATCH --cpus-per-task={args.workers}"])
    array += ["# one input-file group per task: writes PREFIX_gNNNNN and its .done.json, or nothing", cd,
              f"exec {py} group {shlex.quote(plan_file)} \"$SLURM_ARRAY_TASK_ID\""]
    manifest = _header("megafixed-preprocess-manifest", f"{slurm_dir}/manifest_%j.out", args,
                       ["#SBATCH --cpus-per-task=1"])
    manifest += ["# after the whole array (afterany): verifies every group, writes PREFIX.manifest.json or refuses",
                 cd, f"exec {py} manifest {shlex.quote(plan_file)}"]
    return "\n".join(array) + "\n", "\n".join(manifest) + "\n"


def _sbatch(script: str, dependency: str | None = None) -> str:
    if shutil.which("sbatch") is None:
        raise DataError("sbatch is not on PATH: run --submit on a Slurm login node (or add --dry-run to see the "
                        "scripts)")
    cmd = ["sbatch", "--parsable", *([f"--dependency=afterany:{dependency}"] if dependency else []), script]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise DataError(f"sbatch refused {script} ({(out.stderr or out.stdout).strip()})")
    return out.stdout.strip().split(";")[0]


def submit(args, inputs: list[str]) -> int:
    from ..atomic import atomic_write_text
    from ..outputs import OutputError

    if args.nodes < 1 or (args.groups is not None and args.groups < 1):
        raise DataError(f"--nodes {args.nodes} / --groups {args.groups} must be >= 1")
    check_options(DataError, partition=args.partition, account=args.account, time=args.time)
    problem = first_problem(path_problem("--output-prefix", os.path.abspath(args.output_prefix),
                                         "choose another --output-prefix"),
                            path_problem("working directory", os.getcwd(), "run from another directory"))
    if problem:
        raise DataError(problem)
    prefix = os.path.abspath(args.output_prefix)
    plan = pg.make_plan(prefix, inputs, args.groups or args.nodes, _options(args))
    plan_file, manifest = pg.plan_path(prefix), pg.manifest_path(prefix)
    old = pg.load_plan(plan_file) if os.path.exists(plan_file) else None
    if not args.overwrite:
        if os.path.exists(manifest):
            raise OutputError(f"{manifest} exists: this corpus is done; pass --overwrite to redo it")
        if old is not None and pg.plan_digest(old) != pg.plan_digest(plan):
            raise OutputError(f"{plan_file} holds another plan (other inputs, options or --groups); pass "
                              f"--overwrite to replace it and its shards, or use another --output-prefix")
    n = len(plan["groups"])
    if args.overwrite:
        todo = list(range(n))
    else:
        todo = [i for i in range(n) if pg.verify_group(plan, i) is not None]
        stale = [i for i in todo if pg.group_has_shards(prefix, i)]
        if stale:
            raise OutputError(f"group(s) {stale} have shards that are not verified complete "
                              f"({pg.verify_group(plan, stale[0])}); pass --overwrite to redo them")
    slurm_dir = prefix + ".slurm"
    array, man = render(args, plan_file, todo or [0], slurm_dir)
    sizes = [sum(s for _, s, _ in grp) for grp in plan["groups"]]
    print(f"plan: {len(inputs)} files in {n} groups ({min(sizes) / 1e6:.1f}..{max(sizes) / 1e6:.1f} MB each); "
          f"to run: {todo if todo else 'none'}; skipped (complete and verified): "
          f"{[i for i in range(n) if i not in todo] or 'none'}")
    if args.dry_run:
        print(f"--- {slurm_dir}/array.sbatch\n{array}--- {slurm_dir}/manifest.sbatch\n{man}", end="")
        return 0
    if args.overwrite:
        for i in range(max(n, len(old["groups"]) if old else 0)):
            pg.clean_group(prefix, i)
        if os.path.exists(manifest):
            os.remove(manifest)
    os.makedirs(slurm_dir, exist_ok=True)
    atomic_write_text(plan_file, json.dumps(plan, indent=1))
    for name, text in (("array.sbatch", array), ("manifest.sbatch", man)):
        atomic_write_text(os.path.join(slurm_dir, name), text)
    array_id = _sbatch(os.path.join(slurm_dir, "array.sbatch")) if todo else None
    manifest_id = _sbatch(os.path.join(slurm_dir, "manifest.sbatch"), array_id)
    print(f"submitted array job {array_id or '(none: every group is done)'} and manifest job {manifest_id}; "
          f"logs in {slurm_dir}/; then train with data.prefixes=[{manifest}]")
    return 0


# ----------------------------------------------------------------------------------- the tasks
def _run_group(plan_file: str, index: int) -> int:
    from ..data.preprocess import PreprocessOptions, preprocess
    from ..data.readers import DEFAULT_MAX_RECORD_BYTES

    # scancel / a time limit sends SIGTERM: unwind so the writer removes its temp files (no half shard)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    plan = pg.load_plan(plan_file)
    o = plan["options"]

    def run(paths, out_prefix):
        return preprocess(PreprocessOptions(
            inputs=paths, output_prefix=out_prefix, tokenizer=o["tokenizer"], json_keys=o["json_keys"],
            workers=o["workers"], append_eod=o["append_eod"], shard_size_mb=o["shard_size_mb"], strict=o["strict"],
            text_split=o["text_split"], code_bits=o["code_bits"], batch_records=o["batch_records"],
            chunk_mb=o["chunk_mb"], backend=o["backend"], verify_chars=o["verify_chars"], progress=False,
            max_record_bytes=o.get("max_record_bytes", DEFAULT_MAX_RECORD_BYTES),  # a plan written before it
            group=index))

    rec = pg.run_group(plan, index, run)
    print(f"group {index}: {rec['documents']} documents, {rec['tokens']} tokens in {len(rec['shards'])} shard(s)")
    return 0


def _write_manifest(plan_file: str) -> int:
    m = pg.write_manifest(pg.load_plan(plan_file))
    print(f"wrote {pg.manifest_path(pg.load_plan(plan_file)['prefix'])}: {len(m['shards'])} shards, "
          f"{m['documents']} documents, {m['tokens']} tokens")
    return 0


def main(argv: list[str]) -> int:
    from .. import errors

    try:
        if len(argv) == 3 and argv[0] == "group":
            return _run_group(argv[1], int(argv[2]))
        if len(argv) == 2 and argv[0] == "manifest":
            return _write_manifest(argv[1])
        raise DataError(f"usage: python -m {__name__} group PLAN INDEX | manifest PLAN (got {argv})")
    except Exception as exc:
        return errors.report(exc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
