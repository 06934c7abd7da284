"""Zero-shot scores of the model being trained, from inside the training loop, split over the
data-parallel ranks.

The requests and metrics are ``megafixed eval``'s (``harness.prepare`` / ``harness.summarize``) and
so are the forward passes (``Scorer.batches``: the same packed rows in the same batches). Each DP rank
runs every ``dp``-th batch; the per-request log-likelihoods are summed over the DP group (each one
comes from exactly one rank, the others add zeros), so every rank ends with the numbers one process
would compute. Every rank runs the same number of forwards -- a rank short of a batch repeats one
and drops its result -- because under ZeRO-3 / FSDP2 a forward is collective (parameters are
gathered per block).

The training state is left as it was: train/eval mode restored, no autograd graph, and every random
generator (Python, numpy, torch, this rank's CUDA device) restored, so a run trains to the same
bits with the evaluation on or off.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch


@contextlib.contextmanager
def evaluation_of(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode, no autograd, and every RNG state as it was (torch's CPU and this rank's CUDA
    generator through ``torch.random.fork_rng``, Python's and numpy's), around scoring a training
    model. (no_grad, not inference mode: FSDP2 and ZeRO-3 keep gathered parameters across calls, and
    the training step must not meet inference tensors.)"""
    import random

    import numpy as np

    was_training, python_state, numpy_state = model.training, random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    model.eval()
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            yield
    finally:
        model.train(was_training)
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _group_size_rank(group) -> tuple[int, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def score_groups(scorer, groups: list, group=None) -> list[list[tuple[float, bool]]]:
    """``Scorer.score(groups)``'s result, each DP rank of ``group`` (None: the default group, or one
    process) running its share of the batches."""
    import torch.distributed as dist

    from .packed import score_rows

    batches = scorer.batches(groups)
    dp, rank = _group_size_rank(group)
    offsets, total = [], 0
    for g in groups:
        offsets.append(total)
        total += len(g)
    # fp64 holds an fp32 sum exactly; x + 0.0 is x, so the sum over ranks is each request's one value
    found = torch.zeros(2, total, dtype=torch.float64, device=scorer.device)
    rounds = -(-len(batches) // dp)
    for k in range(rounds):
        i = rank + k * dp
        mine = i < len(batches)
        for gi, ri, ll, greedy in score_rows(scorer.model, batches[i if mine else 0], scorer.device):
            if mine:
                found[0, offsets[gi] + ri] = ll
                found[1, offsets[gi] + ri] = float(greedy)
        scorer.forwards += 1
    if dp > 1:
        dist.all_reduce(found, group=group)
    lls, greedy = found[0].tolist(), found[1].tolist()
    return [[(lls[offsets[gi] + ri], greedy[offsets[gi] + ri] > 0.5) for ri in range(len(g))]
            for gi, g in enumerate(groups)]


def metric_values(out: dict, tasks: list[str]) -> dict[str, float]:
    """``{"eval/<task>/<metric>": value}``: every metric ``megafixed eval`` reports for each task asked
    (acc, acc_norm; LAMBADA's acc and perplexity); a group (``mmlu``) as its score and its categories'."""
    from .tasks import ALIASES, GROUPS, TASKS

    values: dict[str, float] = {}
    for name in tasks:
        name = ALIASES.get(name, name)
        if name in GROUPS:
            for g, r in out["groups"].items():
                if g == name or g.startswith(f"{name}_"):
                    values[f"eval/{g}/acc"] = float(r["acc"])
            continue
        for metric in TASKS[name].metrics:
            values[f"eval/{name}/{metric}"] = float(out["results"][name][metric])
    return values


class ZeroShotScorer:
    """The requests of ``tasks`` built once (documents read, tokenized); called with a model, their
    metrics (``metric_values``) on every rank of ``group``."""

    def __init__(self, tasks: list[str], *, limit: Optional[int], tokenizer, batch_size: int = 32,
                 data_dir: Optional[str] = None):
        from .harness import prepare

        self.tasks, self.batch_size = list(tasks), batch_size
        self.prepared = prepare(self.tasks, tokenizer, limit=limit, data_dir=data_dir)

    def __call__(self, model: torch.nn.Module, *, group=None, device: Optional[torch.device] = None) -> dict:
        from .harness import summarize
        from .scoring import Scorer

        with evaluation_of(model):
            scorer = Scorer(model, batch_size=self.batch_size, device=device, progress=False)
            scored = score_groups(scorer, self.prepared.groups, group)
        return metric_values(summarize(self.prepared, scored), self.tasks)


def score_zero_shot(model: torch.nn.Module, *, tasks: list[str], limit: Optional[int], tokenizer,
                    batch_size: int = 32, data_dir: Optional[str] = None, group=None,
                    device: Optional[torch.device] = None) -> dict[str, float]:
    """``{"eval/hellaswag/acc_norm": ..., ...}`` of ``model`` (a plain GPT, or this rank's FSDP2 /
    DeepSpeed module at TP = PP = 1) on the first ``limit`` documents of each task, the DP ranks of
    ``group`` splitting the work; every rank of ``group`` must call it."""
    scorer = ZeroShotScorer(tasks, limit=limit, tokenizer=tokenizer, batch_size=batch_size, data_dir=data_dir)
    return scorer(model, group=group, device=device)
