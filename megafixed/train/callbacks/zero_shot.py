"""In-loop zero-shot evaluation: every ``eval.interval`` steps (and at the last step) the benchmark
scores of the model being trained, as ``megafixed eval`` computes them on a checkpoint
(``megafixed.eval.in_loop``), logged as metrics (``eval/<task>/<metric>``) beside the loss.

Data-parallel layouts only (TP = PP = 1, any DP, any ZeRO stage or FSDP2): the DP ranks split the
forward passes; a tensor- or pipeline-parallel model has no plain forward on one rank. Under context
parallelism every rank scores whole rows (``parallel.context.whole_sequences``) and the data- and
context-parallel ranks split the forward passes between them."""
from __future__ import annotations

import time
from typing import Optional

from ...config import EvalConfig
from ...errors import ConfigError
from .base import Callback, RunContext


def check_tasks(section: EvalConfig) -> None:
    """Every name in ``eval.tasks`` is one ``megafixed eval`` knows (one line naming them otherwise)."""
    from ...eval.tasks import TaskError, parse_tasks

    try:
        parse_tasks(section.tasks)
    except TaskError as exc:
        raise ConfigError(str(exc).replace("--tasks", "eval.tasks", 1)) from None


def check_layout(tp: int, pp: int) -> None:
    if tp != 1 or pp != 1:
        raise ConfigError(f"eval.interval needs parallel.tp=1 and parallel.pp=1 (this run: tp={tp}, pp={pp}); "
                          f"set eval.interval=0 and score its checkpoints with `megafixed eval`")


class ZeroShotEval(Callback):
    """Scores ``section.tasks`` after every ``section.interval``-th update and the last one."""

    name = "zero_shot"

    def __init__(self, section: EvalConfig, max_steps: int):
        self.section, self.max_steps = section, max_steps
        self.run: Optional[RunContext] = None
        self.scorer = None

    def setup(self, run: RunContext) -> None:
        from ...data.tokenizers import load_tokenizer
        from ...eval.in_loop import ZeroShotScorer
        from ...paths import resolve

        check_layout(run.topo.tp, run.topo.pp)
        self.run = run
        tok_path = resolve(run.cfg.data.tokenizer)
        if not tok_path:
            raise ConfigError("eval.interval needs a tokenizer to build the benchmark requests; set data.tokenizer")
        tok = load_tokenizer(tok_path)
        if tok.eod_id is None:
            raise ConfigError(f"eval.interval: tokenizer {tok_path} has no end-of-document token, which scoring "
                              f"needs as the empty-context prefix (as lm-eval uses EOS)")
        # documents read and tokenized once; every evaluation reuses the requests
        self.scorer = ZeroShotScorer(self.section.tasks, limit=self.section.limit, tokenizer=tok,
                                     batch_size=self.section.batch_size)

    def due(self, step: int) -> bool:
        return step % self.section.interval == 0 or step == self.max_steps

    def after_step(self, step: int) -> None:
        if not self.due(step):
            return
        run = self.run
        from ...parallel.context import whole_sequences

        t0 = time.perf_counter()
        group, _ = run.topo.loss_group  # dp, times cp under context parallelism
        with whole_sequences(run.engine.module):
            values = self.scorer(run.engine.module, group=group, device=run.engine.device)
        run.log_metrics(step, values)
        shown = ", ".join(f"{k[len('eval/'):]} {v:.4g}" for k, v in values.items())
        run.say(f"step {step}: zero-shot {shown} ({time.perf_counter() - t0:.1f} s)")


def build(section: EvalConfig, cfg) -> Optional[ZeroShotEval]:
    """The callback, or None when ``eval.interval`` is 0; a layout it cannot score is refused here,
    before the run starts."""
    if section.interval <= 0:
        return None
    check_tasks(section)
    check_layout(cfg.parallel.tp, cfg.parallel.pp)
    return ZeroShotEval(section, cfg.train.max_steps)
