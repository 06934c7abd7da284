"""Train and evaluate every run of a study; skip what is finished, resume what was interrupted."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Optional

from ..atomic import atomic_write_text
from ..config import load_config
from ..run.run_dir import RunDirectory
from ..train.checkpoint import CheckpointError, tag_step
from .plan import StudyRun

EVAL_FILE = "study_eval.json"


class StudyStopped(Exception):
    """A run was stopped on request (exit 75): the study stops too and resumes when rerun."""


def run_config(config: Optional[str], overrides: list[str], run: StudyRun):
    return load_config(config, [*overrides, *run.overrides])


def is_finished(run: StudyRun, max_steps: int) -> bool:
    try:
        tag = RunDirectory(run.run_dir).read_latest()
    except CheckpointError:
        return False
    return tag is not None and tag_step(tag) >= max_steps


def train_run(config: Optional[str], overrides: list[str], run: StudyRun, stop=None) -> None:
    """Train (or resume) one run in this process, exactly as ``megafixed train`` would.

    In-process rather than a subprocess per run: a fresh process pays ~5 s of imports and
    DeepSpeed start-up per run, which dominates a small study; the trainer is re-entrant (one
    Topology per process, engines built per run). A stop request (SIGUSR1) stops the study too.
    """
    from ..data.prepare import prepare_data
    from ..parallel import setup_distributed
    from ..run_plan import RunPlan
    from ..train.trainer import train

    cfg = run_config(config, overrides, run)
    topo = setup_distributed(RunPlan.for_launch(cfg))
    cfg = prepare_data(cfg, is_main=topo.is_main, progress=False)
    result = train(cfg, topo, stop=stop, log=lambda *_: None)
    if result.stopped:
        raise StudyStopped(f"{run.run_dir} was stopped at step {result.step}; rerun the study to resume it")


def evaluate_run(run: StudyRun, cfg, tasks: str = "", limit: int = 0) -> dict:
    """Final metrics of a finished run, cached in the run dir per checkpoint tag and task spec."""
    run_dir = Path(run.run_dir)
    tag = RunDirectory(run_dir).read_latest()
    spec = {"tasks": tasks, "limit": limit}
    cached = run_dir / EVAL_FILE
    if cached.exists():
        old = json.loads(cached.read_text())
        if old.get("checkpoint") == tag and old.get("eval_spec") == spec:
            return old
    from ..model.params import count_params
    from .heldout import heldout_metrics

    recs = RunDirectory(run_dir).read_metrics()
    vals = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    counts = count_params(cfg.model)
    result = {"interface": run.interface, "seed": run.seed, "point": run.point_name, "checkpoint": tag,
              "steps": tag_step(tag), "trainable_params": counts.trainable, "input_params": counts.input,
              "final_val_loss": vals[-1][1] if vals else math.nan, "eval_spec": spec,
              "val_curve": vals, "train_loss_last": next((r["loss"] for r in reversed(recs) if "loss" in r), None)}
    result.update(heldout_metrics(cfg, run_dir))
    result["tasks"] = zero_shot(run_dir, tasks, limit) if tasks else {}
    atomic_write_text(cached, json.dumps(result, indent=1))
    return result


def zero_shot(run_dir: Path, tasks: str, limit: int) -> dict:
    """``{task: primary metric}`` on the first ``limit`` items, scored as lm-eval scores them;
    {} when the benchmark data package is not installed (the report says so)."""
    from ..config import load_config
    from ..data.tokenizers import load_tokenizer
    from ..eval.data import package_root
    from ..eval.harness import evaluate
    from ..eval.tasks import TASKS
    from ..train.evaluate import load_trained_model

    if package_root() is None:
        return {}
    cfg = load_config(str(RunDirectory(run_dir).config_file))
    if not cfg.data.tokenizer:
        return {}  # token shards without a tokenizer cannot be given benchmark text
    model, _ = load_trained_model(cfg, run_dir)
    out = evaluate(model, load_tokenizer(cfg.data.tokenizer), tasks, limit=limit or None, progress=False)
    return {name: {"metric": TASKS[name].primary, "value": r[TASKS[name].primary], "n": r["n"],
                   "chance": r.get("chance")} for name, r in out["results"].items()}


def run_study(config: Optional[str], overrides: list[str], runs: list[StudyRun],
              log: Callable[[str], None] = print, stop=None, tasks: str = "", limit: int = 0) -> list[dict]:
    results = []
    for i, run in enumerate(runs, 1):
        cfg = run_config(config, overrides, run)
        what = f"[{i}/{len(runs)}] {run.point_name} {run.interface} seed {run.seed}"
        if is_finished(run, cfg.train.max_steps):
            log(f"{what}: finished earlier, skipped")
        else:
            log(f"{what}: training ({cfg.train.max_steps} steps) -> {run.run_dir}")
            train_run(config, overrides, run, stop)
        results.append(evaluate_run(run, cfg, tasks, limit))
    return results
