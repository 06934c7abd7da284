"""What users run: ``torchrun ... -m megafixed.cli train CONFIG overrides`` under TP, PP, SP and ZeRO
layouts logs the same losses and gradient norms (metrics.jsonl) as the single-process run, resumes
bit-exactly within a layout, and its checkpoint gathers to the single-process weights."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from _metrics import assert_matches, assert_rows_match, read_metrics
from _train_data import REFERENCE_STEPS, reference_overrides
from megafixed.engine.weights import gather_state_dict

ROOT = Path(__file__).resolve().parent.parent
STEPS = REFERENCE_STEPS


@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards  # the session's, so the shared single-process reference runs read the same files


def _overrides(shards, run_dir, kind, *extra):
    return reference_overrides(shards, run_dir, kind, *extra)


@pytest.fixture(scope="module")
def reference(tiny_reference):
    """Single-process ``megafixed train`` for both input kinds (conftest: trained once per session,
    the very command ``_overrides`` gives without a layout)."""
    return tiny_reference("canonical", "learned")


def _train(torchrun, nproc, shards, run_dir, kind, *layout):
    torchrun(nproc, ["-m", "megafixed.cli", "train", "/dev/null", *_overrides(shards, run_dir, kind, *layout)])


def _assert_resume_is_bit_exact(torchrun, nproc, shards, run_dir, kind, *layout):
    """Rewind a finished run to its step-2 checkpoint, rerun the same command: steps 3-4 log the
    very same numbers."""
    rerun = Path(str(run_dir) + "_resumed")
    shutil.copytree(run_dir, rerun)
    shutil.rmtree(rerun / "checkpoints" / f"step_{STEPS:08d}")
    (rerun / "checkpoints" / "latest").write_text("step_00000002\n")
    _train(torchrun, nproc, shards, rerun, kind, *layout)
    straight, resumed = read_metrics(run_dir, "loss"), read_metrics(rerun, "loss")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert_rows_match(straight[2:], resumed[2:], "resume changed", rtol=0)


def _assert_loads_as_the_reference(run_dir, ref_dir):
    """The one loading path (evaluation, export) gathers this layout's checkpoint, config included."""
    from megafixed.train.evaluate import load_trained_model

    got, tag = load_trained_model(None, run_dir)
    ref, ref_tag = load_trained_model(None, ref_dir)
    assert tag == ref_tag == f"step_{STEPS:08d}"
    ref_params = dict(ref.named_parameters())
    for name, p in got.named_parameters():
        assert torch.allclose(p, ref_params[name], rtol=0, atol=2e-5), name


def _assert_weights_match(run_dir, ref_dir):
    tag = f"step_{STEPS:08d}"
    got = gather_state_dict(Path(run_dir) / "checkpoints", tag)
    ref = gather_state_dict(Path(ref_dir) / "checkpoints", tag)
    assert sorted(got) == sorted(ref)
    for key in ref:
        assert torch.allclose(got[key], ref[key], rtol=0, atol=2e-5), key


@pytest.mark.multiprocess
def test_train_tp2_fixed_codes_matches_and_resumes(shards, reference, torchrun, tmp_path):
    layout = ("parallel.tp=2", "train.activation_checkpointing=true")
    _train(torchrun, 2, shards, tmp_path / "run", "canonical", *layout)
    assert_matches(tmp_path / "run", reference["canonical"], "train tp2 canonical")
    _assert_resume_is_bit_exact(torchrun, 2, shards, tmp_path / "run", "canonical", *layout)
    _assert_weights_match(tmp_path / "run", reference["canonical"])
    _assert_loads_as_the_reference(tmp_path / "run", reference["canonical"])


@pytest.mark.multiprocess
def test_train_pp2_learned_matches_and_resumes(shards, reference, torchrun, tmp_path):
    layout = ("parallel.pp=2", "train.activation_checkpointing=true")
    _train(torchrun, 2, shards, tmp_path / "run", "learned", *layout)
    assert_matches(tmp_path / "run", reference["learned"], "train pp2 learned")
    _assert_resume_is_bit_exact(torchrun, 2, shards, tmp_path / "run", "learned", *layout)
    _assert_weights_match(tmp_path / "run", reference["learned"])
    _assert_loads_as_the_reference(tmp_path / "run", reference["learned"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind,layout", [
    # ZeRO-0: the trainer computes the norm itself (megafixed.engine.deepspeed.grad_norm), with SP's
    # all-reduced norm gradients counted once
    ("learned", ("parallel.tp=2", "parallel.sequence_parallel=true", "zero.stage=0")),
    ("canonical", ("zero.stage=3",)),
])
def test_train_other_layouts_match(shards, reference, torchrun, tmp_path, kind, layout):
    _train(torchrun, 2, shards, tmp_path / "run", kind, *layout)
    assert_matches(tmp_path / "run", reference[kind], f"train {layout} {kind}")
    _assert_loads_as_the_reference(tmp_path / "run", reference[kind])  # ZeRO-3 through zero_to_fp32


@pytest.mark.multiprocess
@pytest.mark.four_procs
def test_train_tp2_pp2_matches_resumes_and_gathers(shards, reference, torchrun, tmp_path):
    layout = ("parallel.tp=2", "parallel.pp=2")
    _train(torchrun, 4, shards, tmp_path / "run", "canonical", *layout)
    assert_matches(tmp_path / "run", reference["canonical"], "train tp2xpp2 canonical")
    _assert_resume_is_bit_exact(torchrun, 4, shards, tmp_path / "run", "canonical", *layout)
    _assert_weights_match(tmp_path / "run", reference["canonical"])  # TP2*PP2 -> TP1*PP1


@pytest.mark.multiprocess
@pytest.mark.four_procs
def test_train_pp2_dp2_learned_matches(shards, reference, torchrun, tmp_path):
    _train(torchrun, 4, shards, tmp_path / "run", "learned", "parallel.pp=2", "train.micro_batch=2")
    assert_matches(tmp_path / "run", reference["learned"], "train pp2xdp2 learned")
