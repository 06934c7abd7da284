"""Zero-/few-shot evaluation of a plain GPT on the benchmark tasks: documents -> requests ->
log-likelihoods (``scoring.Scorer``) -> metrics, plus the paper-style table."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from . import metrics as M
from .data import load_docs
from .scoring import Scorer, encode_pair
from .tasks import MMLU_CATEGORIES, TASKS, TaskError, category_of, fewshot_context, parse_tasks


def build_requests(task, docs: list[dict], tok, num_fewshot: int = 0, fewshot_docs: Optional[list[dict]] = None):
    """Each document's ``Doc`` (prompt strings) and its token requests."""
    built, groups, cache = [], [], {}
    for doc in docs:
        d = fewshot_context(task, doc, (fewshot_docs or [])[:num_fewshot]) if (num_fewshot or task.description(doc)) \
            else task.build(doc)
        built.append(d)
        groups.append([encode_pair(tok, c, x, cache) for c, x in zip(d.contexts, d.continuations)])
    return built, groups


@dataclass
class Prepared:
    """Every task's documents as token requests, ready to score (``groups``: one per document, in
    task order), and what ``summarize`` needs to turn their log-likelihoods into metrics."""

    plan: list  # (name, task, built Docs) per task
    sources: dict  # task -> {"source", "split"}
    groups: list  # every document's requests, all tasks in order
    num_fewshot: int
    limit: Optional[int]


def prepare(tasks: str | list[str], tok, *, limit: Optional[int] = None, num_fewshot: int = 0,
            data_dir: Optional[str] = None) -> Prepared:
    """Load each task's first ``limit`` documents (per MMLU subject), as the harness's --limit, and
    build their requests."""
    names = parse_tasks(tasks)
    if num_fewshot:
        bad = [n for n in names if TASKS[n].fewshot_split is None]
        if bad:
            raise TaskError(f"--num-fewshot {num_fewshot}: the bundled data has no training split for "
                            f"{', '.join(bad)} to draw examples from (only MMLU ships its dev split); "
                            f"evaluate those zero-shot")
    plan, sources, all_groups = [], {}, []
    for name in names:
        task = TASKS[name]
        docs, where, split = load_docs(name, data_dir, task.required)
        docs = docs[:limit] if limit else docs
        shots = None
        if num_fewshot:
            shots, _, _ = load_docs(name, data_dir, task.required, split=task.fewshot_split)
            if len(shots) < num_fewshot:
                raise TaskError(f"--num-fewshot {num_fewshot}: {name} has {len(shots)} few-shot examples")
        built, groups = build_requests(task, docs, tok, num_fewshot, shots)
        plan.append((name, task, built))
        all_groups += groups
        sources[name] = {"source": where, "split": split}
    return Prepared(plan, sources, all_groups, num_fewshot, limit)


def summarize(prepared: Prepared, scored: list, keep_items: bool = False) -> dict:
    """``{"results": {task: aggregate}, "groups": {...}, "items": ...}`` from the scored requests
    (``Scorer.score(prepared.groups)``)."""
    results, items, k = {}, {}, 0
    for name, task, built in prepared.plan:
        task_items = []
        for d in built:
            r = scored[k]
            k += 1
            if task.kind == "loglikelihood":
                task_items.append(M.lambada_item(*r[0]))
            else:
                task_items.append(M.choice_item([ll for ll, _ in r], d.choices, d.gold))
        results[name] = M.aggregate(task, task_items)
        if task.kind == "multiple_choice":  # a uniform guess's expected accuracy (ARC has 3-5 choices)
            results[name]["chance"] = sum(1 / len(d.choices) for d in built) / len(built)
        if keep_items:
            items[name] = task_items
    groups = {}
    mmlu = {n: r for n, r in results.items() if n.startswith("mmlu_")}
    if mmlu:
        cats = {}
        for cat in MMLU_CATEGORIES:
            members = {n: r for n, r in mmlu.items() if category_of(n) == cat}
            if members:
                cats[f"mmlu_{cat}"] = M.aggregate_group(members)
        groups.update(cats)
        groups["mmlu"] = M.aggregate_group(cats)
    out = {"results": results, "groups": groups}
    if keep_items:
        out["items"] = items
    return out


def evaluate(model, tok, tasks: str | list[str], *, limit: Optional[int] = None, batch_size: int = 32,
             num_fewshot: int = 0, data_dir: Optional[str] = None, progress: bool = True,
             share_prefix: bool = True, keep_items: bool = False) -> dict:
    """``{"results": {task: aggregate}, "groups": {...}, "tasks": {task: source}, "items": ...}``.

    ``limit``: the first N documents of each task (per MMLU subject), as the harness's --limit.
    """
    t0 = time.perf_counter()
    prepared = prepare(tasks, tok, limit=limit, num_fewshot=num_fewshot, data_dir=data_dir)
    scorer = Scorer(model, batch_size=batch_size, progress=progress, share_prefix=share_prefix)
    # one scoring pass over every task's requests: packing works across tasks
    scored = scorer.score(prepared.groups)
    out = summarize(prepared, scored, keep_items)
    items = out.pop("items", None)
    out.update({"tasks": prepared.sources, "num_fewshot": num_fewshot, "limit": limit,
                "seconds": time.perf_counter() - t0, "forward_passes": scorer.forwards,
                "requests": sum(len(g) for g in prepared.groups)})
    if keep_items:
        out["items"] = items
    return out


def table_rows(out: dict) -> list[tuple[str, str, float, Optional[float], int, Optional[float]]]:
    """(task, metric, value, stderr, n, chance) rows: every task's primary metric, MMLU as one row."""
    rows = []
    for name, r in out["results"].items():
        if name.startswith("mmlu_"):
            continue
        task = TASKS[name]
        rows.append((name, task.primary, r[task.primary], r.get(f"{task.primary}_stderr"), r["n"], r.get("chance")))
        if name == "lambada":
            rows.append((name, "perplexity", r["perplexity"], r.get("perplexity_stderr"), r["n"], None))
    if "mmlu" in out["groups"]:
        g = out["groups"]["mmlu"]
        rows.append(("mmlu", "acc", g["acc"], g.get("acc_stderr"), g["n"], 0.25))
    return rows


def format_table(out: dict, chance: bool = True) -> str:
    head = f"{'task':<16}{'metric':<12}{'value':>9}{'± stderr':>11}{'items':>8}" + (f"{'chance':>9}" if chance else "")
    lines = [head, "-" * len(head)]
    for name, metric, value, se, n, ch in table_rows(out):
        pct = metric.startswith("acc")
        v = f"{100 * value:.2f}" if pct else f"{value:.4g}"
        s = "" if se is None else (f"{100 * se:.2f}" if pct else f"{se:.3g}")
        c = "" if ch is None else f"{100 * ch:.1f}"
        lines.append(f"{name:<16}{metric:<12}{v:>9}{s:>11}{n:>8}" + (f"{c:>9}" if chance else ""))
    lines.append("acc: accuracy (%); acc_norm: accuracy with each choice's log-likelihood divided by its length "
                 "in characters (%); perplexity: LAMBADA's last word (lower is better)")
    return "\n".join(lines)
