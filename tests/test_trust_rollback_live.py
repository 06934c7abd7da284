"""Issue 50 [trust], the rollback verb live: a run's own rollback scans the checkpoint it reloads.

A tiny run per engine checkpoints at steps 2 and 4 and is drilled to a NaN at step 5
(``guard.on_nonfinite=rollback``), so its rollback reads the step-4 checkpoint. The run is paused before
step 5 (``MEGAFIXED_PAUSE=train.step@5``: step 4's checkpoint is complete, nothing of step 5 has run);
while it waits the test plants a pickled payload into that checkpoint (the manifest rewritten to match,
as whoever can write the files can do), then releases it. The rollback must refuse in one line naming
the planted file and the payload's global, exit 2, the payload never runs and the run trains no further.
The pause, not the clock, orders the plant before the read.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_trust_checkpoints import READ_BY_ALL, ROOT, _cmd, _env, _one_error, _plant

from _pause import ended, pause_env, wait_paused
from _train_data import write_shards

ENGINES = ("deepspeed", "torch")
TAG4 = "step_00000004"
# READ_BY_ALL: the file each engine's rollback unpickles first and unrestricted (DeepSpeed's model states,
# DCP's .metadata): without the scan the payload runs there and the run rolls back and finishes (exit 0)
DRILL = ("train.max_steps=6", "checkpoint.interval=2", "guard.on_nonfinite=rollback", "faults.inject=nan@5")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("trust_rollback") / "shards")


def _records(metrics: Path) -> list:
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _steps(metrics: Path) -> list:
    """The steps that trained (a record with a loss), in order."""
    return [r["step"] for r in _records(metrics) if "loss" in r]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_live_rollback_refuses_a_checkpoint_planted_while_the_run_waits(shards, tmp_path, engine):
    run, marker, paused = tmp_path / "run", tmp_path / "PWNED", tmp_path / "paused"
    log = tmp_path / "train.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(_cmd(shards, run, f"train.engine={engine}", *DRILL), cwd=ROOT,
                                env={**_env(), **pause_env("train.step@5", paused)}, stdout=subprocess.DEVNULL,
                                stderr=err, text=True)
        try:
            wait_paused(paused, ended(proc, log))
            ckpts = run / "checkpoints"
            assert (ckpts / "latest").read_text() == TAG4 + "\n"  # step 4's checkpoint is committed
            assert _steps(run / "metrics.jsonl") == [1, 2, 3, 4]
            victim = ckpts / TAG4 / READ_BY_ALL[engine]
            _plant(victim.parent, victim.name, marker)
            paused.unlink()  # the release: step 5 runs, turns NaN, and the rollback reads step 4
            rc = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = log.read_text()
    assert not marker.exists(), "the planted payload ran: " + stderr[-3000:]
    assert rc == 2, stderr[-3000:]
    line = _one_error("\n".join(ln for ln in stderr.splitlines() if not ln.startswith("paused at ")))
    assert str(victim) in line and "would import" in line and "nothing was loaded" in line, line
    assert "pathlib" in line or "builtins.getattr" in line, line  # the payload's global, named
    # nothing was loaded and nothing trained on: past step 4 the metrics hold only the guard's record of the
    # NaN that asked for the rollback, and no checkpoint was written past step 4
    records = _records(run / "metrics.jsonl")
    assert _steps(run / "metrics.jsonl") == [1, 2, 3, 4], records
    after = [r for r in records if r["step"] > 4]
    assert len(after) == 1 and set(after[0]) == {"step", "bad_step"}, after
    assert after[0]["step"] == 5 and after[0]["bad_step"]["action"] == "rollback", after
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000002", TAG4]
