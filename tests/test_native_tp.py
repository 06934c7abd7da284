"""The torch engine's DTensor tensor/sequence parallelism (``megafixed.engine.native.tensor``)
equals the plain single-process GPT: one 2-rank gloo launch trains every case a few AdamW steps
(tests/native_tp_worker.py) against the plain model built in-process from the same seed."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from _metrics import assert_matches, assert_rows_match, read_metrics

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
        for step, (a, b) in enumerate(zip(r["loss"], r["ref_loss"], strict=True)):
            assert math.isclose(a, b, rel_tol=RTOL), f"{name}: step {step + 1} loss {a} vs {b}"
        # clip_grad_norm_ over DTensors counts every parameter once (sharded ones summed over TP)
        for step, (a, b) in enumerate(zip(r["grad_norm"], r["ref_grad_norm"], strict=True)):
            assert math.isclose(a, b, rel_tol=RTOL), f"{name}: step {step + 1} grad_norm {a} vs {b}"
        assert math.isclose(r["eval_loss"], r["ref_eval_loss"], rel_tol=RTOL), \
            f"{name}: evaluation loss {r['eval_loss']} vs {r['ref_eval_loss']}"
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
        # Megatron's communication, no more: per block one reduction of attention's and one of the
        # MLP's output forward and of their input gradients backward, one for the head's input
        # gradient, one for a learned table's lookup; never a gather of the [B, T, V] logits
        layers, table = 2, int("input.embedding.weight" in shapes)
        if sp:  # all-gather before attention, the MLP, the head; reduce-scatter after wo, w_out, the table
            assert r["collectives"] == {
                "forward": {"all_gather_into_tensor": 2 * layers + 1, "reduce_scatter_tensor": 2 * layers + table},
                "backward": {"reduce_scatter_tensor": 2 * layers + 1, "all_gather_into_tensor": 2 * layers + table},
            }, f"{name}: {r['collectives']}"
        else:
            assert r["collectives"] == {"forward": {"all_reduce": 2 * layers + table},
                                        "backward": {"all_reduce": 2 * layers + 1}}, f"{name}: {r['collectives']}"
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


def _train_matches_reference(tiny_shards, reference, torchrun, tmp_path, kind, nproc, layout, header):
    from _train_data import REFERENCE_STEPS, reference_overrides

    run_dir = tmp_path / "run"
    proc = torchrun(nproc, ["-m", "megafixed.cli", "train", "/dev/null",
                            *reference_overrides(tiny_shards, run_dir, kind, "train.engine=torch", *layout)])
    # one launch, several checks: the layout really run, then the per-step loss and gradient norm
    # (the logged norm is the whole model's, every TP shard counted once: DeepSpeed's reference norm)
    assert header in proc.stdout, proc.stdout[-2000:]
    assert_matches(run_dir, reference[kind], str(layout), steps=REFERENCE_STEPS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind,layout", [
    # fixed codes: no input communication at all; activation checkpointing recomputes DTensor blocks
    ("canonical", ("parallel.tp=2", "train.activation_checkpointing=true")),
    # vocab-parallel table, reduce-scattered: extended, as the default run makes the same equality for the learned
    # table under TP2+SP with FSDP2 over it (test_train_torch_engine_fsdp2_times_tp_sp_matches_and_resumes_as_fsdp2_dp4)
    pytest.param("learned", ("parallel.tp=2", "parallel.sequence_parallel=true"), marks=pytest.mark.extended),
])
def test_train_torch_engine_tp_matches_deepspeed_single_process(tiny_shards, reference, torchrun, tmp_path,
                                                                 kind, layout):
    # both ranks in the TP group (dp 1): the numbers come from split weights
    _train_matches_reference(tiny_shards, reference, torchrun, tmp_path, kind, 2, layout,
                             "micro 4 x accum 2 x dp 1, tp 2, pp 1, fp32")


@pytest.mark.multiprocess
@pytest.mark.four_procs
def test_train_torch_engine_fsdp2_times_tp_sp_matches_and_resumes_as_fsdp2_dp4(tiny_shards, reference, torchrun,
                                                                                 tmp_path):
    # 2-D: FSDP2 over dp=2 of TP2+SP DTensors (torchtitan's layout), the learned table split both ways
    layout = ("parallel.tp=2", "parallel.sequence_parallel=true")
    _train_matches_reference(tiny_shards, reference, torchrun, tmp_path, "learned", 4, layout,
                             "micro 4 x accum 1 x dp 2, tp 2, pp 1, fp32")
    # DCP reshards the TP x FSDP2 step-2 checkpoint (model and AdamW state) onto FSDP2 over dp=4
    # without TP: steps 3-4 continue the uninterrupted run
    from _train_data import REFERENCE_STEPS, reference_overrides

    run_dir, rerun = tmp_path / "run", tmp_path / "rerun"
    shutil.copytree(run_dir, rerun)
    shutil.rmtree(rerun / "checkpoints" / f"step_{REFERENCE_STEPS:08d}")
    (rerun / "checkpoints" / "latest").write_text("step_00000002\n")
    torchrun(4, ["-m", "megafixed.cli", "train", "/dev/null",
                 *reference_overrides(tiny_shards, rerun, "learned", "train.engine=torch", "parallel.tp=1",
                                      "parallel.sequence_parallel=false", "train.micro_batch=2")])
    straight, resumed = read_metrics(run_dir, "loss"), read_metrics(rerun, "loss")
    assert [r["step"] for r in resumed] == list(range(1, REFERENCE_STEPS + 1))
    assert_rows_match(straight[2:], resumed[2:], "FSDP2 dp=4 resumed", rtol=RTOL)
