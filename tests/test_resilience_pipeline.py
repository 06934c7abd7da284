"""The bad-step guard and the loss faults under pipeline parallelism, on both engines.

A pipeline schedule computes the loss itself, on the last stage, and (DeepSpeed's ``train_batch``) ends
in the update, so neither the step-loop's injected loss nor a verdict after the step reaches it. Here a
2-rank PP2 run per engine gets ``spike@5:factor=1000`` and ``nan@7`` (``guard.on_spike=skip``,
``guard.on_nonfinite=skip``, a checkpoint every step): both verdicts are given, on both ranks (each repeats when
the step is computed again: ``guard.recheck``), and each skipped update leaves every stage's weights and
optimizer state as the step before left them, bit for bit, while the steps around them train. ``nan@3:once`` is a
transient fault: the recomputation of step 3 through the schedule is good, trained on, and rank 1 (the last stage,
which holds the loss) is named; every checkpoint from step 3 on is bit-identical to a run without it.
"""
from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from test_resilience import _tensors  # every tensor of a checkpoint's nested state, by name

from _train_data import tiny_overrides

pytestmark = pytest.mark.multiprocess

INJECT = "spike@5:factor=1000;nan@7"
TRANSIENT = "nan@3:once"  # the re-checked runs' only difference from the references
RUN = ("parallel.pp=2", "train.max_steps=8", "checkpoint.interval=1", "checkpoint.keep=0",
       "validation.interval=0", "guard.spike_window=4", "guard.on_spike=skip", "guard.on_nonfinite=skip")
ENGINES = ("deepspeed", "torch")


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory, torchrun):
    """{engine: (run_dir, log)} with the transient fault, and {"<engine>-reference": ...} without it; two
    launches at a time (four ranks)."""
    names = [*ENGINES, *(f"{e}-reference" for e in ENGINES)]
    dirs = {name: tmp_path_factory.mktemp(f"pp2_{name}") / "run" for name in names}

    def launch(name):
        engine, _, reference = name.partition("-")
        return torchrun(2, ["-m", "megafixed.cli", "train", "/dev/null",
                            *tiny_overrides(tiny_shards, dirs[name], f"train.engine={engine}", *RUN,
                                            f"faults.inject={INJECT if reference else f'{INJECT};{TRANSIENT}'}")])

    with ThreadPoolExecutor(2) as pool:
        outs = dict(zip(names, pool.map(launch, names)))
    return {name: (dirs[name], outs[name].stdout + outs[name].stderr) for name in names}


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _state(engine: str, tag_dir: Path, scratch: Path) -> dict:
    """Every stage's weights and optimizer state in one checkpoint, by name."""
    if engine == "torch":  # DCP, read by its own converter
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        out = scratch / f"{tag_dir.name}.pt"
        dcp_to_torch_save(str(tag_dir), str(out))
        saved = torch.load(out, weights_only=False)
        return dict(_tensors({k: v for k, v in saved.items() if k in ("model", "optimizer")}))
    state = {}
    for f in sorted(tag_dir.glob("layer_*-model_states.pt")):  # DeepSpeed's pipeline: one file per layer
        state.update(_tensors(torch.load(f, weights_only=False), f.name))
    for f in sorted(tag_dir.glob("*optim_states.pt")):  # ZeRO-1: one partition per stage
        opt = torch.load(f, weights_only=False)["optimizer_state_dict"]
        state.update(_tensors({"adam": opt["base_optimizer_state"]["state"],
                               "fp32": opt["single_partition_of_fp32_groups"]}, f.name))
    return state


@pytest.mark.parametrize("engine", ENGINES)
def test_a_pipeline_run_skips_an_injected_spike_and_nan_before_the_update(runs, engine, tmp_path):
    run_dir, log = runs[engine]
    recs = _records(run_dir)
    got = [(v["step"], v["kind"], v["what"], v["action"]) for v in (r["bad_step"] for r in recs if "bad_step" in r)]
    assert got == [(5, "spike", "loss", "skip"), (7, "nonfinite", "loss", "skip")], (got, log[-3000:])
    loss = {r["step"]: r["loss"] for r in recs if "loss" in r}
    assert loss[5] > 100 * loss[4] and math.isnan(loss[7]), loss  # the faults reached the last stage's loss
    assert log.count("bad step 5:") >= 1 and log.count("bad step 7:") >= 1, log[-3000:]

    ckpt = run_dir / "checkpoints"
    states = {s: _state(engine, ckpt / f"step_{s:08d}", tmp_path) for s in (4, 5, 6, 7, 8)}
    assert len(states[4]) > 10 and all(states[s].keys() == states[4].keys() for s in states)
    for before, skipped in ((4, 5), (6, 7)):
        for name, value in states[before].items():  # the update of the bad step was dropped, on every stage
            assert torch.equal(value, states[skipped][name]), (engine, skipped, name)
    for before, trained in ((5, 6), (7, 8)):
        assert any(not torch.equal(v, states[trained][n]) for n, v in states[before].items()), (engine, trained)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_pipeline_run_trains_on_the_recomputation_of_a_transient_nan(runs, engine, tmp_path):
    run_dir, log = runs[engine]
    rows = [json.loads(line) for line in (run_dir / "faults" / "bad_steps.jsonl").read_text().splitlines()]
    transient = [r for r in rows if r.get("recheck") == "transient"]
    assert [(r["step"], r["kind"], r["ranks"]) for r in transient] == [(3, "nonfinite", [1])], (rows, log[-3000:])
    assert [r["step"] for r in rows if r.get("recheck") == "repeated"] == [5, 7]
    recs = {r["step"]: r for r in _records(run_dir) if "loss" in r}
    assert math.isfinite(recs[3]["loss"]) and not recs[3].get("skipped") and recs[3]["loss"] == \
        transient[0]["recomputed"]["loss"]
    ckpt, reference = run_dir / "checkpoints", runs[f"{engine}-reference"][0] / "checkpoints"
    two, three = (_state(engine, ckpt / f"step_{s:08d}", tmp_path) for s in (2, 3))
    assert any(not torch.equal(v, three[n]) for n, v in two.items())  # step 3 trained
    for step in (3, 5, 8):  # every stage's weights and Adam state: the run without the fault's, bit for bit
        (tmp_path / "ref").mkdir(exist_ok=True)
        ours, theirs = _state(engine, ckpt / f"step_{step:08d}", tmp_path), \
            _state(engine, reference / f"step_{step:08d}", tmp_path / "ref")
        assert ours.keys() == theirs.keys() and all(torch.equal(v, theirs[n]) for n, v in ours.items()), step
