"""The torch engine's DTensor tensor/sequence parallelism (``megafixed.engine.native.tensor``)
equals the plain single-process GPT: one 2-rank gloo launch trains every case a few AdamW steps
(tests/native_tp_worker.py) against the plain model built in-process from the same seed."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-5


@pytest.fixture(scope="module")
def tp_cases(torchrun, tmp_path_factory):
    out = tmp_path_factory.mktemp("native_tp") / "cases.json"
    torchrun(2, [str(ROOT / "tests" / "native_tp_worker.py"), str(out)])
    return json.loads(out.read_text())




@pytest.mark.multiprocess
def test_native_tp_matches_single_process(tp_cases):
    from native_tp_worker import CASES, STEPS

    assert sorted(tp_cases) == sorted(CASES)
    for name, r in tp_cases.items():
        sp = CASES[name][1]
        assert len(r["loss"]) == len(r["ref_loss"]) == STEPS, name
        for step, (a, b) in enumerate(zip(r["loss"], r["ref_loss"])):
            assert math.isclose(a, b, rel_tol=RTOL), f"{name}: step {step + 1} loss {a} vs {b}"
        # clip_grad_norm_ over DTensors counts every parameter once (sharded ones summed over TP)
        for step, (a, b) in enumerate(zip(r["grad_norm"], r["ref_grad_norm"])):
            assert math.isclose(a, b, rel_tol=RTOL), f"{name}: step {step + 1} grad_norm {a} vs {b}"
        # the first step's gradients before any optimizer step, then after two AdamW updates
        assert r["grad_diff"][0] < RTOL, f"{name}: step-1 gradients differ by {r['grad_diff'][0]:.2e}"
        assert max(r["grad_diff"]) < 10 * RTOL, f"{name}: gradients differ by {r['grad_diff']}"
        assert r["weight_abs_diff"] < 1e-5, f"{name}: weights after {STEPS} steps differ by {r['weight_abs_diff']}"
        # really tensor parallel: same names, every parameter a DTensor, the Linears split in two
        assert r["params"] == r["ref_params"], name
        assert r["not_dtensor"] == [], f"{name}: plain parameters {r['not_dtensor']}"
        shapes = r["local_shapes"]
        assert shapes["blocks.0.attn.wq.weight"] == [32, 64] and shapes["blocks.0.attn.wo.weight"] == [64, 32], name
        head = "input.embedding.weight" if "tied" in r else "head.proj.weight"  # a tied head is the table
        assert shapes[head] == [128, 64], name  # vocabulary-parallel head
        assert r["logits"] == ["DTensor", ["S(2)"], [4, 32, 128]], f"{name}: logits {r['logits']}"
        if "input.embedding.weight" in shapes:
            assert shapes["input.embedding.weight"] == [128, 64], name  # vocabulary-parallel table
        # sequence parallelism: the residual stream holds T/tp positions per rank
        assert r["norm_input"] == ([4, 16, 64] if sp else [4, 32, 64]), f"{name}: {r['norm_input']}"
        if "tied" in r:
            assert r["tied"], f"{name}: the tied head and table came apart"


# ----------------------------------------------------------------------------- through megafixed train
@pytest.fixture(scope="module")
def reference(tiny_reference):
    """The single-process DeepSpeed ``megafixed train`` of both input kinds (conftest, once per session)."""
    # a run saves at its last step: it needs the torch engine's DCP checkpoints (issue 21's
    # native/checkpoint.py, another branch of this issue until they are merged); checked before
    # the reference runs are paid for
    pytest.importorskip("megafixed.engine.native.checkpoint", reason="the torch engine's checkpoints are not here")
    return tiny_reference("canonical", "learned")


def _metrics(run_dir) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def _train_matches_reference(tiny_shards, reference, torchrun, tmp_path, kind, nproc, layout, header):
    from _train_data import REFERENCE_STEPS, reference_overrides

    run_dir = tmp_path / "run"
    proc = torchrun(nproc, ["-m", "megafixed.cli", "train", "/dev/null",
                            *reference_overrides(tiny_shards, run_dir, kind, "train.engine=torch", *layout)])
    # one launch, several checks: the layout really run, then the per-step loss and gradient norm
    assert header in proc.stdout, proc.stdout[-2000:]
    got, ref = _metrics(run_dir), _metrics(reference[kind])
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, REFERENCE_STEPS + 1))
    for a, b in zip(got, ref):
        assert math.isclose(a["loss"], b["loss"], rel_tol=RTOL), \
            f"{layout}: step {a['step']} loss {a['loss']} vs {b['loss']}"
        # the logged norm is the whole model's, every TP shard counted once (DeepSpeed's reference norm)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=RTOL), \
            f"{layout}: step {a['step']} grad_norm {a['grad_norm']} vs {b['grad_norm']}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind,layout", [
    # fixed codes: no input communication at all; activation checkpointing recomputes DTensor blocks
    ("canonical", ("parallel.tp=2", "train.activation_checkpointing=true")),
    ("learned", ("parallel.tp=2", "parallel.sequence_parallel=true")),  # vocab-parallel table, reduce-scattered
])
def test_train_torch_engine_tp_matches_deepspeed_single_process(tiny_shards, reference, torchrun, tmp_path,
                                                                 kind, layout):
    # both ranks in the TP group (dp 1): the numbers come from split weights
    _train_matches_reference(tiny_shards, reference, torchrun, tmp_path, kind, 2, layout,
                             "micro 4 x accum 2 x dp 1, tp 2, pp 1, fp32")


@pytest.mark.multiprocess
@pytest.mark.four_procs
def test_train_torch_engine_fsdp2_times_tp_sp_matches_deepspeed_single_process(tiny_shards, reference, torchrun,
                                                                                 tmp_path):
    # 2-D: FSDP2 over dp=2 of TP2+SP DTensors (torchtitan's layout), the learned table split both ways
    _train_matches_reference(tiny_shards, reference, torchrun, tmp_path, "learned", 4,
                             ("parallel.tp=2", "parallel.sequence_parallel=true"),
                             "micro 4 x accum 1 x dp 2, tp 2, pp 1, fp32")
