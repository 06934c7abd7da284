"""One side of ``megafixed bench eval``, in its own process so that each side's wall time includes
its start-up and model loading (as a user would time ``megafixed eval`` or ``lm_eval``) and both get
exactly the thread count asked:

``python -m megafixed.bench.eval_side {ours|hf} MODEL YAMLS TASKS LIMIT BATCH THREADS OUT``

``ours``: ``megafixed.eval.harness.evaluate`` on the imported checkpoint MODEL; ``hf``: lm-eval's own
``HFLM`` (``lm_eval --model hf``) on the transformers directory MODEL, through the task YAMLs in
YAMLS (``megafixed.eval.harness_tasks``). OUT gets per-item log-likelihoods and accuracies and each
task's metrics, in one shape for both sides.
"""
from __future__ import annotations

import json
import sys
import time


def run_ours(model: str, tasks: list[str], limit: int, batch: int) -> dict:
    from ..eval.harness import evaluate
    from ..eval.load import load

    loaded = load(model, device="cpu", dtype="float32")
    out = evaluate(loaded.model, loaded.tokenizer, tasks, limit=limit, batch_size=batch, progress=False,
                   keep_items=True)
    items = {t: [{"lls": [it["ll"]] if "ll" in it else it["lls"], "acc": int(it["acc"]),
                  **({"acc_norm": int(it["acc_norm"])} if "acc_norm" in it else {})} for it in its]
             for t, its in out["items"].items()}
    metrics = {t: {k: r[k] for k in ("acc", "acc_norm", "perplexity") if k in r} for t, r in out["results"].items()}
    return {"items": items, "metrics": metrics, "requests": out["requests"], "forward_passes": out["forward_passes"]}


def run_hf(model: str, yamls: str, tasks: list[str], limit: int, batch: int) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from ..eval.harness_tasks import harness_name

    lm = HFLM(pretrained=model, batch_size=batch, device="cpu", dtype="float32")
    res = simple_evaluate(model=lm, tasks=[harness_name(t) for t in tasks], limit=limit, bootstrap_iters=0,
                          log_samples=True, task_manager=TaskManager(include_path=yamls, include_defaults=False))
    items, metrics = {}, {}
    for t in tasks:
        samples = sorted(res["samples"][harness_name(t)], key=lambda s: s["doc_id"])
        items[t] = [{"lls": [float(r[0]) for r in s["filtered_resps"]], "acc": int(s["acc"]),
                     **({"acc_norm": int(s["acc_norm"])} if "acc_norm" in s else {})} for s in samples]
        r = res["results"][harness_name(t)]
        metrics[t] = {k: float(r[f"{k},none"]) for k in ("acc", "acc_norm", "perplexity") if f"{k},none" in r}
    return {"items": items, "metrics": metrics}


def main(argv: list[str]) -> None:
    side, model, yamls, tasks, limit, batch, threads, out = argv
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(int(threads))
    tasks_list = tasks.split(",")
    if side == "ours":
        result = run_ours(model, tasks_list, int(limit), int(batch))
    else:
        result = run_hf(model, yamls, tasks_list, int(limit), int(batch))
    result.update(seconds_in_process=time.perf_counter() - t0, threads=torch.get_num_threads(), batch_size=int(batch))
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
