"""Wall time: ``megafixed eval``'s evaluator vs lm_eval through the ``megafixed`` adapter, same items.

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
    print(json.dumps({"items_per_task": n, "tasks": Q.TASKS, "requests": out["requests"],
                      "forward_passes": out["forward_passes"], "lm_eval_adapter_s": round(t_ref, 2),
                      "megafixed_eval_s": round(t_ours, 2), "ratio": round(t_ref / t_ours, 2),
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
