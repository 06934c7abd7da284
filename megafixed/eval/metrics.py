"""Per-document metrics and their aggregation, as lm-evaluation-harness computes them.

* multiple choice (``ConfigurableTask.process_results``): ``acc`` = argmax of the summed
  log-likelihoods is gold; ``acc_norm`` = argmax of log-likelihood / *character* length of the
  choice string (``len(choice)``: the harness's ``completion_len``, not its byte length; for
  English text the two differ only on non-ASCII characters);
* LAMBADA (``loglikelihood``): ``acc`` = greedy decoding reproduces the last word,
  ``perplexity`` = exp(-mean log-likelihood);
* standard errors: ``mean_stderr`` (sample standard deviation / sqrt(n)) for means; MMLU groups are
  size-weighted means with ``pooled_sample_stderr``, level by level (subjects -> 4 categories -> mmlu).
  The harness bootstraps the perplexity's standard error (100,000 resamples); we give the delta-method
  value exp(-m) * stderr(log-likelihood) instead (a first-order approximation of the same quantity).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np


def mean_stderr(values: Sequence[float]) -> Optional[float]:
    n = len(values)
    if n < 2:
        return None
    mu = sum(values) / n
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (n - 1)) / math.sqrt(n)


def pooled_stderr(stderrs: Sequence[float], sizes: Sequence[int]) -> Optional[float]:
    if len(stderrs) != len(sizes) or any(s is None for s in stderrs) or sum(sizes) - len(sizes) <= 0:
        return None
    var = sum((n - 1) * s ** 2 * n for n, s in zip(sizes, stderrs)) / (sum(sizes) - len(sizes))
    return float(np.sqrt(var / sum(sizes)))


def choice_item(lls: Sequence[float], choices: Sequence[str], gold: int) -> dict:
    """One multiple-choice document's outcome (np.argmax: the first of equal maxima, as the harness)."""
    lls_arr = np.array(lls, dtype=np.float64)
    pred = int(np.argmax(lls_arr))
    pred_norm = int(np.argmax(lls_arr / np.array([float(len(c)) for c in choices])))
    return {"lls": [float(x) for x in lls], "gold": gold, "pred": pred, "pred_norm": pred_norm,
            "acc": 1.0 if pred == gold else 0.0, "acc_norm": 1.0 if pred_norm == gold else 0.0}


def lambada_item(ll: float, is_greedy: bool) -> dict:
    return {"ll": float(ll), "acc": int(is_greedy)}


def aggregate(task, items: list[dict]) -> dict:
    """``{metric: value, metric_stderr: value, "n": docs}`` for one task."""
    out: dict = {"n": len(items)}
    if task.kind == "loglikelihood":
        lls = [it["ll"] for it in items]
        accs = [float(it["acc"]) for it in items]
        m = sum(lls) / len(lls)
        out["acc"], out["acc_stderr"] = sum(accs) / len(accs), mean_stderr(accs)
        se = mean_stderr(lls)
        out["perplexity"] = math.exp(-m)
        out["perplexity_stderr"] = None if se is None else math.exp(-m) * se
        return out
    for metric in task.metrics:
        vals = [it[metric] for it in items]
        out[metric], out[f"{metric}_stderr"] = sum(vals) / len(vals), mean_stderr(vals)
    return out


def aggregate_group(members: dict[str, dict], metric: str = "acc") -> dict:
    """Size-weighted mean and pooled standard error of ``members`` (name -> aggregate)."""
    sizes = [m["n"] for m in members.values()]
    values = [m[metric] for m in members.values()]
    return {"n": sum(sizes), metric: sum(v * n for v, n in zip(values, sizes)) / sum(sizes),
            f"{metric}_stderr": pooled_stderr([m[f"{metric}_stderr"] for m in members.values()], sizes)}
