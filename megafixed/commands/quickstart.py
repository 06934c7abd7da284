"""``megafixed quickstart [overrides]``: the main job, end to end on a CPU.

1. prepare data: train a 4096-token BPE on the bundled corpus and tokenize it (cached after the
   first run, in the user cache: ``megafixed.paths.cache_dir()``);
2. train the packaged ``megafixed/bundled/quickstart.yaml`` (canonical fixed code) with DeepSpeed on CPU;
3. evaluate the final checkpoint: held-out *test*-split loss and perplexity, plus a greedy sample;
4. a zero-shot slice: 200 items each of HellaSwag, PIQA and LAMBADA (``megafixed eval``), next to chance;
5. print where the metrics, TensorBoard events and checkpoints are (also in ``quickstart.json``).

Running it again resumes (or, when finished, just re-evaluates) the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..atomic import atomic_write_text
from ..config import load_config
from ..paths import bundled, resolve

HELP = "the main job: tokenize the bundled corpus, train a small fixed-code GPT on CPU, evaluate it"
# Packaged with the library (not found via a repository checkout) so that a regular `pip install .`
# runs the main job from any directory.
DEFAULT_CONFIG = bundled("quickstart.yaml")
DEFAULT_PROMPTS = ("The capital of France is", "In mathematics, a prime number")


def add_arguments(p):
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.max_steps=100")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="run config (default: %(default)s)")
    p.add_argument("--sample-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    p.add_argument("--zero-shot-items", type=int, default=200,
                   help="items each of HellaSwag, PIQA and LAMBADA in the final zero-shot slice (0: skip it)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def _anchor_paths(cfg) -> None:
    """``bundled:<name>`` data paths -> the packaged files (prepare_data resolves them too; doing it
    here keeps the printed config honest). Other relative paths stay relative to the cwd."""
    d = cfg.data
    d.source = resolve(d.source)
    d.tokenizer = resolve(d.tokenizer)


def run(args) -> int:
    import signal

    from .. import exit_codes
    from ..engine import prepare_runtime_env
    from ..errors import report
    from ..train.stop import StopRequest

    prepare_runtime_env()
    t_start = time.perf_counter()
    stop = StopRequest()  # Ctrl-C, USR1, TERM: save at the step and exit; rerunning resumes (as `train`)
    stop.install_signal_handlers((signal.SIGUSR1, signal.SIGTERM), interrupt=True)
    try:
        cfg = load_config(args.config, args.overrides)
        _anchor_paths(cfg)
        quickstart(cfg, sample_tokens=args.sample_tokens, t_start=t_start, zero_shot_items=args.zero_shot_items,
                   stop=stop)
        code = exit_codes.OK
        if stop.requested:
            code = exit_codes.INTERRUPTED if stop.interrupted else exit_codes.STOPPED
    except Exception as exc:  # noqa: BLE001 -- the error boundary decides what is a bug
        code = report(exc)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip DeepSpeed's atexit teardown (a rare SIGABRT after a finished run); all files are closed.
    os._exit(code)


def quickstart(cfg, sample_tokens: int = 32, t_start: float | None = None,
               zero_shot_items: int = 0, stop=None) -> dict | None:
    import torch.distributed as dist

    from ..data.gpt_dataset import build_datasets
    from ..data.prepare import prepare_data
    from ..data.tokenizers import load_tokenizer
    from ..model.generate import SamplingConfig, complete
    from ..parallel import setup_distributed
    from ..run.run_dir import RunDirectory
    from ..run_plan import RunPlan
    from ..train.evaluate import evaluate_loss, load_trained_model
    from ..train.trainer import train

    t_start = t_start or time.perf_counter()
    topo = setup_distributed(RunPlan.for_launch(cfg))
    say = print if topo.is_main else (lambda *_: None)

    say("== 1/4 data: tokenizing the bundled corpus (cached after the first run)")
    t0 = time.perf_counter()
    cfg = prepare_data(cfg, is_main=topo.is_main, progress=False)
    if dist.is_initialized():
        dist.barrier()
    datasets = build_datasets(cfg.data, seed=cfg.train.seed)
    say(f"   tokenizer {cfg.data.tokenizer}\n   shards    {cfg.data.prefixes[0]}.bin/.idx\n   samples   "
        + ", ".join(f"{k} {len(v) if v is not None else 0}" for k, v in datasets.items())
        + f" (seq_len {cfg.data.seq_len}); {time.perf_counter() - t0:.1f}s")

    say(f"== 2/4 train: {cfg.model.n_layers} layers x {cfg.model.d_model}, input={cfg.model.input}, "
        f"{cfg.train.max_steps} steps")
    t0 = time.perf_counter()
    result = train(cfg, topo, datasets=datasets, stop=stop)
    train_s = time.perf_counter() - t0
    if not topo.is_main:
        return {}
    if result.stopped:  # the trainer said where it saved; `megafixed quickstart` again resumes
        return None

    say("== 3/4 evaluate the final checkpoint on the held-out test split")
    model, tag = load_trained_model(cfg, cfg.train.run_dir)
    test = evaluate_loss(cfg, model, datasets["test"], micro_batch=cfg.train.micro_batch)
    tok = load_tokenizer(cfg.data.tokenizer)
    # `megafixed generate RUN --prompt P --max-new-tokens N` prints the same greedy text (one path)
    greedy = SamplingConfig(max_new_tokens=sample_tokens, stop_ids=(tok.eod_id,))
    samples = [{"prompt": prompt, "completion": complete(model, tok, prompt, greedy)} for prompt in DEFAULT_PROMPTS]
    rd = RunDirectory(Path(cfg.train.run_dir).resolve())
    vals = [r["val_loss"] for r in rd.read_metrics() if "val_loss" in r]
    run_dir = rd.path
    summary = {
        "run_dir": str(run_dir), "checkpoint": str(rd.tag_dir(tag)), "metrics": str(rd.metrics_file),
        "tensorboard": str(rd.tensorboard_dir) if cfg.metrics.tensorboard else None,
        "config": str(rd.config_file), "steps": result.step,
        "val_loss_first": vals[0] if vals else None, "val_loss_last": vals[-1] if vals else None,
        "test_loss": test.loss, "test_perplexity": test.perplexity, "test_tokens": test.tokens,
        "samples": samples, "train_seconds": train_s, "total_seconds": time.perf_counter() - t_start,
    }
    atomic_write_text(run_dir / "quickstart.json", json.dumps(summary, indent=2))

    say(f"   test loss {test.loss:.4f}  perplexity {test.perplexity:.1f}  ({test.tokens:,} tokens)")
    if vals:
        say(f"   validation loss {vals[0]:.4f} (step 0) -> {vals[-1]:.4f} (step {result.step})")
    for s in samples:
        say(f"   sample: {s['prompt']!r} -> {s['completion']!r}")
    if zero_shot_items:
        summary["zero_shot"] = _zero_shot_slice(model, tok, zero_shot_items, say)
    summary["total_seconds"] = time.perf_counter() - t_start  # the whole job, the zero-shot slice included
    atomic_write_text(run_dir / "quickstart.json", json.dumps(summary, indent=2))
    say(f"\nmetrics     {summary['metrics']}\n"
        + (f"tensorboard {summary['tensorboard']}\n" if summary["tensorboard"] else "")
        + f"checkpoint  {summary['checkpoint']}\nsummary     {run_dir / 'quickstart.json'}\n"
        f"done in {summary['total_seconds'] / 60:.1f} min (training {train_s / 60:.1f} min"
        + (f", zero-shot slice {summary['zero_shot']['seconds'] / 60:.1f} min" if summary.get("zero_shot") else "")
        + ")")
    return summary


ZERO_SHOT_TASKS = "hellaswag,piqa,lambada"


def _zero_shot_slice(model, tok, items: int, say) -> dict | None:
    """Step 4: the first ``items`` of HellaSwag, PIQA and LAMBADA, scored as lm-evaluation-harness
    scores them (``megafixed eval``), printed next to chance. Skipped, with the install line, when
    the benchmark data package is missing: the main job does not depend on it."""
    from ..eval.data import INSTALL, package_root
    from ..eval.harness import evaluate, format_table

    say(f"== 4/4 zero-shot slice: {items} items each of {ZERO_SHOT_TASKS.replace(',', ', ')}")
    if package_root() is None:
        say(f"   skipped: the benchmark sets are not installed (`{INSTALL}`)")
        return None
    out = evaluate(model, tok, ZERO_SHOT_TASKS, limit=items, progress="lines")  # a line every 30 s
    say("   " + format_table(out).replace("\n", "\n   "))
    say("   A 4-layer model trained for minutes on CPU scores near chance: this table shows the path (real\n"
        "   benchmark items, lm-evaluation-harness scoring), not capability. Full sets: `megafixed eval RUN`.\n"
        f"   ({out['requests']:,} requests in {out['seconds']:.0f}s)")
    return {"results": out["results"], "limit": items, "seconds": out["seconds"]}
