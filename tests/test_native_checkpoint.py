"""The torch engine's DCP checkpoints through ``megafixed train`` (CPU, fp32, gloo).

One uninterrupted DP2 (FSDP2) run of the tiny reference model, 12 steps with a checkpoint every 4
and asynchronous saves, is the reference for everything here:

- a second DP2 run of the same command with synchronous saves, killed with SIGKILL (every rank)
  between saves and started again, logs the reference's losses and gradient norms bit for bit,
  and its checkpoints hold the very tensors the asynchronous saves wrote (async == sync);
- its step-4 checkpoint resumed on ONE process (DCP reshards weights and Adam's state) continues
  within 1e-5 of the reference;
- a checkpoint of one engine resumed by the other is refused in one line (exit 2), and the fix it
  names, ``train.init_from``, moves the weights across engines both ways;
- eval, export hf, convert and ckpt inspect read it, and its weights after 4 steps are those of
  the DeepSpeed engine's single-process reference run (conftest ``tiny_reference``).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _env import launch_free_env
from _metrics import assert_matches, assert_rows_match, logged_step, read_metrics
from _pause import ended, pause_env, wait_paused
from _train_data import reference_overrides

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVE = 12, 4
RTOL = 1e-5
TAG4 = "step_00000004"
# The reference model and data (tests/_train_data.py), on the torch engine, run longer with a
# checkpoint every 4 steps; decay_steps=4 keeps steps 1-4 on the 4-step reference's schedule.
NATIVE = ("train.engine=torch", f"train.max_steps={STEPS}", f"checkpoint.interval={SAVE}", "schedule.decay_steps=4",
          "checkpoint.keep=0")


def _overrides(shards, run_dir, *extra) -> list[str]:
    return reference_overrides(shards, run_dir, "canonical", *NATIVE, *extra)


def _train_cmd(nproc: int, overrides: list[str]) -> list[str]:
    args = ["-m", "megafixed.cli", "train", "/dev/null", *overrides]
    if nproc == 1:
        return [sys.executable, *args]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={port}", *args]


def _env() -> dict:
    return launch_free_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _popen(nproc: int, overrides: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(_train_cmd(nproc, overrides), cwd=ROOT, env={**_env(), **(env or {})},
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (torchrun starts each rank in a session of its own)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return out


def _kill9(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every rank at once, like a node going down."""
    for pid in _tree(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run(nproc: int, overrides: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(_train_cmd(nproc, overrides), cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


class _Background:
    """A ``megafixed train`` started now and judged when first needed."""

    def __init__(self, nproc, overrides, run_dir: Path):
        self.run_dir, self.log = run_dir, run_dir.parent / "train.log"
        self.proc = _popen(nproc, overrides, self.log)

    def wait(self) -> Path:
        try:
            code = self.proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            _kill9(self.proc)
            code = self.proc.wait()
        assert code == 0, self.log.read_text()[-4000:]
        return self.run_dir


@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards  # the session's: the DeepSpeed reference run reads the same files


@pytest.fixture(scope="module")
def native_reference(shards, tmp_path_factory):
    """The uninterrupted DP2 run (async saves), started at once so that the kill test runs beside it."""
    run_dir = tmp_path_factory.mktemp("native_ref") / "run"
    ref = _Background(2, _overrides(shards, run_dir, "checkpoint.async_save=true"), run_dir)
    yield ref
    if ref.proc.poll() is None:
        _kill9(ref.proc)
        ref.proc.wait()


def _rewind(src: Path, dst: Path, tag: str) -> Path:
    """A copy of run ``src`` whose latest checkpoint is ``tag`` (the later ones removed)."""
    shutil.copytree(src, dst)
    ckpt = dst / "checkpoints"
    for d in ckpt.iterdir():
        if d.is_dir() and d.name > tag:
            shutil.rmtree(d)
    (ckpt / "latest").write_text(tag + "\n")
    return dst


def _read_everything(tag_dir: Path, out: Path) -> dict:
    """Every tensor and object of a DCP checkpoint (model and optimizer), by DCP's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tag_dir), str(out))
    return torch.load(out, weights_only=False)


def _assert_same_tree(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(set(a) ^ set(b))[:5])
        for k in a:
            _assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, where


# ----------------------------------------------------------------------------------- kill -9, async == sync
@pytest.mark.multiprocess
def test_kill9_between_saves_then_rerun_is_bit_identical_and_sync_saves_equal_async(shards, native_reference,
                                                                                     tmp_path):
    run_dir = tmp_path / "run"
    overrides = _overrides(shards, run_dir, "checkpoint.async_save=false")
    # rank 0 stops before step SAVE + 2 (a step past a complete checkpoint, before the next one is), rank 1
    # waits for it in that step, until both are killed there
    paused = tmp_path / "victim.paused"
    victim = _popen(2, overrides, tmp_path / "victim.log", pause_env(f"train.step@{SAVE + 2}:rank=0", paused))
    latest = run_dir / "checkpoints" / "latest"
    wait_paused(paused, ended(victim, tmp_path / "victim.log"))
    saved = int(latest.read_text().strip().split("_")[1])
    killed_at = logged_step(run_dir)
    _kill9(victim)
    victim.wait()
    assert killed_at is not None, "the run ended before it could be killed: " + \
        (tmp_path / "victim.log").read_text()[-3000:]
    assert victim.returncode == -signal.SIGKILL and saved < killed_at < STEPS, (saved, killed_at)

    rerun = _run(2, overrides)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-4000:]
    resumed = [ln for ln in rerun.stdout.splitlines() if ln.startswith("resumed from")]
    assert resumed and resumed[0].startswith(f"resumed from {run_dir / 'checkpoints'}") and \
        f"(step {saved}," in resumed[0], rerun.stdout[-3000:]

    ref_dir = native_reference.wait()
    got, want = read_metrics(run_dir, "loss"), read_metrics(ref_dir, "loss")
    assert [r["step"] for r in want] == list(range(1, STEPS + 1))
    keys = ("step", "loss", "grad_norm", "consumed_samples", "lr")
    assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in want]  # same bits

    # Every checkpoint the synchronous runs wrote holds the tensors the asynchronous one wrote:
    # the same shard files, byte for byte, and the same model, optimizer and position.
    for tag in (f"step_{s:08d}" for s in range(SAVE, STEPS + 1, SAVE)):
        a, b = ref_dir / "checkpoints" / tag, run_dir / "checkpoints" / tag
        files_a = {e["name"]: e for e in json.loads((a / "manifest.json").read_text())["files"]}
        files_b = {e["name"]: e for e in json.loads((b / "manifest.json").read_text())["files"]}
        assert set(files_a) == set(files_b)
        shard_files = [n for n in files_a if n.endswith(".distcp")]
        assert len(shard_files) == 2  # one per rank
        for name in shard_files:
            assert files_a[name]["sha256"] == files_b[name]["sha256"], (tag, name)
        _assert_same_tree(_read_everything(a, tmp_path / "a.pt"), _read_everything(b, tmp_path / "b.pt"), tag)
        ca, cb = (torch.load(d / "client_state.pt", weights_only=False) for d in (a, b))
        assert (ca["step"], ca["consumed_samples"]) == (cb["step"], cb["consumed_samples"]) == (int(tag[5:]),
                                                                                               int(tag[5:]) * 8)
        assert len(ca["rng"]) == 2  # both ranks' RNG states
        _assert_same_tree(ca["rng"], cb["rng"], f"{tag}.rng")


# ----------------------------------------------------------------------------------- DP2 -> DP1
@pytest.mark.multiprocess
def test_dp2_checkpoint_resumes_on_one_process_with_its_optimizer_state(shards, native_reference, tmp_path):
    ref_dir = native_reference.wait()
    run_dir = _rewind(ref_dir, tmp_path / "run", TAG4)
    proc = _run(1, _overrides(shards, run_dir, "checkpoint.async_save=true"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    resumed = next(line for line in proc.stdout.splitlines() if line.startswith("resumed from"))
    assert "(step 4, 32 samples consumed)" in resumed
    assert "layout: the data-parallel size (world size / (tp*pp)) 2 -> 1" in resumed, resumed
    got, want = read_metrics(run_dir, "loss"), read_metrics(ref_dir, "loss")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    assert_rows_match(got[4:], want[4:], "dp2 -> dp1", keys=("consumed_samples",), rtol=0)
    assert_rows_match(got[4:], want[4:], "dp2 -> dp1", rtol=RTOL)
    # not trivially equal: Adam's moments matter here (a fresh optimizer would be far off)
    assert got[-1]["loss"] < got[0]["loss"]
    lay = json.loads((run_dir / "checkpoints" / f"step_{STEPS:08d}" / "run.json").read_text())["layout"]
    assert (lay["engine"], lay["dp"]) == ("torch", 1)


@pytest.mark.multiprocess
def test_a_tp2_sp_checkpoint_resumes_on_one_process_with_its_optimizer_state(shards, native_reference, tmp_path):
    """DTensor TP shards (vocab-parallel head, Shard(0)/Shard(1) Linears) resharded into plain tensors."""
    run_dir = tmp_path / "run"
    first = _run(2, _overrides(shards, run_dir, "parallel.tp=2", "parallel.sequence_parallel=true",
                               "train.max_steps=4"))
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-4000:]
    proc = _run(1, _overrides(shards, run_dir))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    resumed = next(line for line in proc.stdout.splitlines() if line.startswith("resumed from"))
    assert "(step 4, 32 samples consumed)" in resumed and "layout: parallel.tp 2 -> 1" in resumed, resumed
    assert_matches(run_dir, native_reference.wait(), "tp2+sp -> tp1", steps=STEPS, rtol=RTOL)


# ----------------------------------------------------------------------------------- the other engine
def _assert_weights_close(got: dict, want: dict, atol: float):
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:6]
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert torch.allclose(got[k].float(), want[k].float(), rtol=0, atol=atol), \
            f"{k}: max diff {(got[k].float() - want[k].float()).abs().max().item()}"


@pytest.mark.multiprocess
def test_the_other_engines_checkpoint_is_refused_in_one_line_and_init_from_crosses_engines(
        shards, native_reference, tiny_reference, tmp_path):
    from megafixed.engine.native.reader import read_state_dict
    from megafixed.engine.weights import gather_state_dict

    ds_ref = tiny_reference("canonical")["canonical"]  # the DeepSpeed engine's single-process run
    ref_dir = native_reference.wait()
    ds_copy, torch_copy = tmp_path / "ds_run", tmp_path / "torch_run"
    shutil.copytree(ds_ref, ds_copy)
    shutil.copytree(ref_dir, torch_copy)
    four = "train.max_steps=4"
    drop_engine = [o for o in _overrides(shards, torch_copy) if o != "train.engine=torch"]
    refusals = {
        "deepspeed": (ds_copy, _train_cmd(1, _overrides(shards, ds_copy, four))),  # its own 4 steps, now torch
        "torch": (torch_copy, _train_cmd(1, [*drop_engine, "train.engine=deepspeed"])),
    }
    procs = {old: subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True) for old, (_, cmd) in refusals.items()}
    for old, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        run_dir = refusals[old][0]
        lines = _error_lines(err)
        assert proc.returncode == 2, err[-3000:]
        assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
        line = lines[0]
        new = "torch" if old == "deepspeed" else "deepspeed"
        assert f"written by train.engine={old}" in line and f"this run has train.engine={new}" in line, line
        assert f"Set train.engine={old} back" in line and "train.init_from=" in line, line
        assert (run_dir / "checkpoints" / "latest").read_text() == (
            (ds_ref if old == "deepspeed" else ref_dir) / "checkpoints" / "latest").read_text()  # nothing touched

    # The fix it names: a new run from those weights, on the other engine. One step at a vanishing
    # learning rate, so the new run's checkpoint must hold the source's weights.
    tiny_lr = ("optimizer.lr=1e-12", "optimizer.min_lr=0", "train.max_steps=1", "checkpoint.interval=1")
    ds_tag, torch_tag = ds_ref / "checkpoints" / TAG4, ref_dir / "checkpoints" / TAG4
    into_torch, into_ds = tmp_path / "into_torch" / "run", tmp_path / "into_ds" / "run"
    starts = [
        _popen(1, [*_overrides(shards, into_torch, *tiny_lr), f"train.init_from={ds_tag}"], tmp_path / "a.log"),
        _popen(1, [o for o in _overrides(shards, into_ds, *tiny_lr) if o != "train.engine=torch"]
               + [f"train.init_from={torch_tag}"], tmp_path / "b.log"),
    ]
    for proc, log in zip(starts, ("a.log", "b.log")):
        assert proc.wait(timeout=600) == 0, (tmp_path / log).read_text()[-4000:]
    step1 = "step_00000001"
    _assert_weights_close(read_state_dict(into_torch / "checkpoints" / step1), gather_state_dict(ds_tag), 1e-8)
    _assert_weights_close(gather_state_dict(into_ds / "checkpoints" / step1), read_state_dict(torch_tag), 1e-8)
    assert "initialised from" in (tmp_path / "a.log").read_text()


# ----------------------------------------------------------------------------------- the readers
def _word_tokenizer(path: Path, vocab: int) -> str:
    """A tokenizer.json with exactly ``vocab`` ids (the tiny model's), end-of-document token included."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return str(path)


@pytest.mark.multiprocess
def test_eval_export_convert_and_inspect_read_a_torch_engine_checkpoint(shards, native_reference, tiny_reference,
                                                                          tmp_path, capsys):
    from megafixed.cli import main
    from megafixed.engine.native.reader import is_native_checkpoint, read_state_dict
    from megafixed.engine.weights import gather_state_dict
    from megafixed.train.evaluate import load_trained_model

    transformers = pytest.importorskip("transformers")
    ref_dir = native_reference.wait()
    ds_ref = tiny_reference("canonical")["canonical"]
    tag_dir = ref_dir / "checkpoints" / TAG4
    assert is_native_checkpoint(tag_dir) and not is_native_checkpoint(ds_ref / "checkpoints" / TAG4)

    # The reader's weights are the DeepSpeed engine's after the same 4 steps (another engine,
    # another layout, another reader): names, shapes and values.
    weights = read_state_dict(tag_dir)
    _assert_weights_close(weights, gather_state_dict(ds_ref / "checkpoints" / TAG4), 2e-5)

    # ckpt inspect: the engine, the DCP files, verified
    assert main(["ckpt", "inspect", str(ref_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tag"] == f"step_{STEPS:08d}" and info["layout"]["engine"] == "torch" and info["layout"]["dp"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "client_state.pt", "run.json"} <= set(info["files"])
    assert info["manifest"]["ok"] is True

    # convert: a plain state dict, and a DeepSpeed TP2 checkpoint, of the same weights
    plain, tp2 = tmp_path / "plain.pt", tmp_path / "tp2"
    assert main(["convert", str(ref_dir / "checkpoints"), str(plain), "--tag", TAG4, "--plain"]) == 0
    _assert_weights_close(torch.load(plain, weights_only=True), weights, 0)
    assert main(["convert", str(tag_dir), str(tp2), "--tp", "2"]) == 0
    _assert_weights_close(gather_state_dict(tp2), weights, 0)
    assert main(["convert", str(tag_dir), "--universal"]) == 2
    assert "already loads on any DP/TP layout" in capsys.readouterr().err

    # eval: the torch checkpoint scores as its DeepSpeed-format copy (the other reader)
    tok = _word_tokenizer(tmp_path / "tokenizer.json", 256)
    scores = []
    for src in (tag_dir, tp2 / "converted"):
        out = tmp_path / f"eval_{len(scores)}.json"
        assert main(["eval", str(src), "--prefix", shards, "--max-docs", "4", "--tokenizer", tok,
                     "--json", str(out), "--device", "cpu"]) == 0
        scores.append(json.loads(out.read_text()))
    assert scores[0]["tokens"] > 100 and scores[0]["perplexity"] == scores[1]["perplexity"]
    capsys.readouterr()

    # export hf: transformers' logits are our model's (the reader -> the one loading path)
    hf_dir = tmp_path / "hf"
    assert main(["export", "hf", str(ref_dir), str(hf_dir), "--tag", TAG4, "--tokenizer", tok]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                           local_files_only=True).eval()
    ours, _ = load_trained_model(None, ref_dir, TAG4)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours.eval()(ids), hf(ids).logits
    assert a.abs().max() > 0.5 and (a - b).abs().max().item() <= 1e-4


# ----------------------------------------------------------------------------------- a full disk
@pytest.fixture
def small_tmpfs(native_reference, tmp_path):
    """A tmpfs with room for one checkpoint of the run but not two (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the full-disk test runs as root in CI)")
    one = sum(p.stat().st_size for p in (native_reference.wait() / "checkpoints" / TAG4).iterdir())
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    size = (int(one * 1.5) // 4096 + 1) * 4096
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_during_an_async_save_is_named_and_keeps_the_previous_checkpoint(shards, small_tmpfs):
    from megafixed.engine.native.reader import read_state_dict

    run_dir = small_tmpfs / "run"
    proc = _run(1, _overrides(shards, run_dir, "checkpoint.async_save=true"))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line, tag8 = lines[0], "step_00000008"
    assert line.startswith("error: the background (checkpoint.async_save) save of checkpoint") and tag8 in line, line
    assert "no space left on device" in line and f"`latest` still names {TAG4}, which is complete" in line, line
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == TAG4 and not (ckpt / tag8).exists()
    assert len(read_state_dict(ckpt / TAG4)) > 4  # verified against its manifest, then read
