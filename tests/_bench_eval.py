"""Wall time: ``megafixed eval``'s evaluator vs lm_eval through the ``megafixed`` adapter and vs
``lm_eval --model hf`` on the same weights exported with ``megafixed export hf``, same items.

Usage: ``HF_DATASETS_OFFLINE=1 python tests/_bench_eval.py ITEMS_PER_TASK [WORK_DIR]`` (figures:
docs/benchmarks.md). The model has the quickstart's shape (4 layers x 192, 128 positions) with a
512-token BPE, untrained: speed does not depend on the weights. Both sides are warmed first.
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import _eval_model as E
    import test_eval_equality as Q
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from megafixed.config import load_config
    from megafixed.eval import lm_eval_adapter
    from megafixed.eval.harness import evaluate
    from megafixed.model import GPT
    from megafixed.paths import bundled

    n = int(sys.argv[1])
    Q.N = n
    root = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/tmp/megafixed-eval-bench")
    root.mkdir(parents=True, exist_ok=True)
    tok = str(root / "tokenizer.json") if (root / "tokenizer.json").exists() else E.make_tokenizer(root)
    cfg = load_config(str(bundled("quickstart.yaml")),
                      ["model.vocab_size=512", "model.code_bits=9", f"data.tokenizer={tok}"])
    E.write_run(cfg, GPT(cfg.model, seed=0), root / "run")
    names = Q._harness_yamls(Q.package_root(), root / "yamls")
    lm = lm_eval_adapter.MegafixedLM(checkpoint=str(root / "run"), batch_size=32, device="cpu")
    tm = TaskManager(include_path=str(root / "yamls"), include_defaults=False)
    simple_evaluate(model=lm, tasks=names, limit=2, bootstrap_iters=2, task_manager=tm, log_samples=False)
    t = time.perf_counter()
    simple_evaluate(model=lm, tasks=names, limit=n, bootstrap_iters=2, task_manager=tm, log_samples=False)
    t_ref = time.perf_counter() - t
    t = time.perf_counter()
    out = evaluate(lm.model, lm.tok, Q.TASKS, limit=n, batch_size=32, progress=False)
    t_ours = time.perf_counter() - t
    # the same weights as a transformers model (Arcee for this RMSNorm + GELU backbone), lm-eval's own hf model
    from lm_eval.models.huggingface import HFLM

    from megafixed.cli import main as cli_main

    if not (root / "hf").exists():
        assert cli_main(["export", "hf", str(root / "run"), str(root / "hf")]) == 0
    hf = HFLM(pretrained=str(root / "hf"), batch_size=32, device="cpu", dtype="float32")
    # lm-eval's hf model asserts on a continuation longer than the context (PIQA's long answers at 128
    # positions), which ours and the adapter score by their last tokens: compare on the other tasks.
    hf_names = [t for t in names if "piqa" not in t]
    hf_tasks = [t for t in Q.TASKS if t != "piqa"]
    simple_evaluate(model=hf, tasks=hf_names, limit=2, bootstrap_iters=2, task_manager=tm, log_samples=False)
    t = time.perf_counter()
    hf_out = simple_evaluate(model=hf, tasks=hf_names, limit=n, bootstrap_iters=2, task_manager=tm,
                             log_samples=False)
    t_hf = time.perf_counter() - t
    t = time.perf_counter()
    sub = evaluate(lm.model, lm.tok, hf_tasks, limit=n, batch_size=32, progress=False)
    t_sub = time.perf_counter() - t
    ours_acc = {k: v.get("acc") for k, v in sub["results"].items()}
    hf_acc = {k: v.get("acc,none") for k, v in hf_out["results"].items()}
    print(json.dumps({"items_per_task": n, "tasks": Q.TASKS, "requests": out["requests"],
                      "forward_passes": out["forward_passes"], "lm_eval_adapter_s": round(t_ref, 2),
                      "megafixed_eval_s": round(t_ours, 2), "ratio": round(t_ref / t_ours, 2),
                      "hf_tasks": hf_tasks, "lm_eval_hf_s": round(t_hf, 2),
                      "megafixed_eval_hf_tasks_s": round(t_sub, 2),
                      "ratio_vs_hf": round(t_hf / t_sub, 2),
                      "acc_ours": ours_acc, "acc_lm_eval_hf": hf_acc,
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
