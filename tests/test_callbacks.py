"""The trainer's callbacks: a user's own callback (from the config and from Python) adds to every metrics
record and keeps its state across a kill -9 and a resume; the old config keys are refused naming their
new place; the trainer's loop names no concrete callback."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from _train_data import tiny_overrides
from megafixed import exit_codes
from megafixed.config import MOVED_KEYS, ConfigError, load_config
from megafixed.errors import describe
from megafixed.train.callbacks import Callback

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


class StepCounter(Callback):
    """A user's callback: counts the steps it has seen (its state) and writes the count into every record."""
    name = "step_counter"

    def __init__(self, field: str = "counted"):
        self.field, self.count = field, 0

    def before_step(self, step: int) -> None:
        self.count += 1

    def on_record(self, step: int, record: dict) -> None:
        record[self.field] = self.count

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])


def _step_records(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def test_a_user_callback_counts_on_across_a_kill_and_a_resume(tiny_shards, tmp_path):
    """Named in the YAML, the callback adds its field to every step's record; the run is SIGKILLed before
    step 5 (checkpoint 4 holds count 4), and resumed from Python with the same callback given as an object:
    its count continues from the checkpoint's, so every record's count is its step, across the kill."""
    run, cfg_file = tmp_path / "run", tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump({"callbacks": [{"name": "test_callbacks:StepCounter",
                                                       "args": {"field": "counted"}}]}))
    over = tiny_overrides(tiny_shards, run, "validation.interval=0", "checkpoint.keep=0", "train.max_steps=6",
                          "checkpoint.interval=2")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "megafixed.cli", "train", str(cfg_file), *over,
                           "faults.inject=exit@5"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9 and "dies (SIGKILL) before step 5" in proc.stderr, proc.stderr[-2000:]
    before = _step_records(run)
    assert [r["step"] for r in before] == [1, 2, 3, 4] and [r["counted"] for r in before] == [1, 2, 3, 4]

    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train import train

    cfg = load_config(None, over)  # no callbacks in the config this time: the same one, given from Python
    counter = StepCounter()
    result = train(cfg, setup_distributed(RunPlan.for_launch(cfg)), log=lambda *_: None, callbacks=[counter])
    assert result.resumed_from == "step_00000004" and result.step == 6
    rows = _step_records(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["counted"] for r in rows] == [1, 2, 3, 4, 5, 6]  # restarted from 0, step 5 would say 1
    assert counter.count == 6


def test_an_unknown_callback_is_one_line_naming_it(tiny_shards, tmp_path):
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train import train

    for name, words in (("no_such_module_here:Thing", "cannot be imported"),
                        ("test_callbacks:Nope", "cannot be imported"),
                        ("test_callbacks", "must be 'package.module:Class'"),
                        ("json:JSONDecoder", "is not a megafixed.train.callbacks.Callback")):
        cfg = load_config(None, tiny_overrides(tiny_shards, tmp_path / "run", "train.max_steps=1"))
        cfg.callbacks = [{"name": name}]
        with pytest.raises(ConfigError) as err:
            train(cfg, setup_distributed(RunPlan.for_launch(cfg)), log=lambda *_: None)
        text = str(err.value)
        assert f"callbacks[0].name={name!r}" in text and words in text and "\n" not in text, text
        assert describe(err.value)[0] == exit_codes.BAD_INPUT
        assert not (tmp_path / "run").exists()  # refused before the run directory is made


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_an_old_key_is_refused_naming_its_new_place(old, tmp_path):
    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({section: {key: 1}}))
    for attempt in (lambda: load_config(str(path)), lambda: load_config(None, [f"{old}=1"])):
        with pytest.raises(ConfigError) as err:
            attempt()
        assert str(err.value) == f"{old} moved to {MOVED_KEYS[old]}"
        assert describe(err.value)[0] == exit_codes.BAD_INPUT


def test_an_old_key_on_the_command_line_exits_2_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megafixed.cli", "train", "/dev/null", "train.on_spike=skip",
                           f"train.run_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == exit_codes.BAD_INPUT and len(errors) == 1, proc.stderr
    assert "train.on_spike moved to guard.on_spike" in errors[0]


def test_the_new_keys_are_the_old_keys_values():
    """Every new place is a real key, taking what the old one took (here: its default type)."""
    cfg = load_config(None)
    for new in MOVED_KEYS.values():
        section, key = new.split(".")
        assert hasattr(getattr(cfg, section), key), new


def _concrete_callback_names() -> set:
    """The names the callbacks package defines beyond the loop's API (base.py, the registration list), a
    callback that is a package (``guard/``) with every module of it."""
    pkg = ROOT / "megafixed" / "train" / "callbacks"
    names = set()
    for path in pkg.rglob("*.py"):
        if path.parent == pkg and path.stem in ("__init__", "base"):
            continue
        names.add(path.parent.name if path.stem == "__init__" else path.stem)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                names.add(node.name)
    return names - {"build"}


def test_the_trainer_names_no_concrete_callback():
    """The loop calls hooks; which concerns a run has is the registration list's business (and the user's)."""
    concrete = _concrete_callback_names()
    assert {"BadSteps", "HangWatch", "Drills", "Metrics", "Validation"} <= concrete  # the check can see them
    tree = ast.parse((ROOT / "megafixed" / "train" / "trainer.py").read_text())
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            used.update((node.module or "").split("."))
            used.update(a.name for a in node.names)
        elif isinstance(node, ast.alias):
            used.add(node.name)
    assert not used & concrete, sorted(used & concrete)
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("callbacks") for a in node.names}
    assert imported <= {"Callback", "RunContext", "Rewind", "CallbackHooks", "build_callbacks"}, imported
