"""Issue 20: no reader uses a checkpoint it has not verified, one run directory has one writer,
and filesystem faults during a save are named.

One tiny run (4 steps, checkpoints at 2 and 4) is trained once through the real CLI; each test
works on a copy. The readers run in-process through ``megafixed.cli.main``; the trainer cases
(two trainers at once, a full disk) are subprocesses because ``train`` leaves via ``os._exit``.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _env import launch_free_env
from _metrics import read_metrics
from _train_data import tiny_overrides, write_shards

ROOT = Path(__file__).resolve().parent.parent
TAG2, TAG4 = "step_00000002", "step_00000004"
MODEL = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
# vocab 320 so that a real (byte-level BPE, 300 ids) tokenizer fits: eval/export/generate need one
EXTRA = ("model.input=canonical", "model.vocab_size=320", "model.code_bits=9", "train.max_steps=4",
         "checkpoint.interval=2", "validation.interval=0", "schedule.warmup_steps=1", "checkpoint.keep=0")


def _cmd(shards, run_dir, *extra):
    return [sys.executable, "-m", "megafixed.cli", "train", "/dev/null",
            *tiny_overrides(shards, run_dir, *EXTRA, *extra)]


def _env():
    # launch_free_env: an earlier in-process test's 1-rank world leaves WORLD_SIZE/RANK/... in os.environ
    env = launch_free_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.pop("MEGAFIXED_TRACEBACK", None)
    return env


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """shards, a tokenizer, a text file, and a trained run (``ws/run``)."""
    from megafixed.data.tokenizers import train_tokenizer

    root = tmp_path_factory.mktemp("integrity")
    shards = write_shards(root / "shards")
    text = root / "text.txt"
    text.write_text(" ".join(f"the river {i} flows north to the sea and back again." for i in range(200)) + "\n")
    tok = train_tokenizer([str(text)], str(root / "tokenizer.json"), 300)
    proc = subprocess.run(_cmd(shards, root / "run"), cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {"root": root, "shards": shards, "tok": tok, "text": str(text), "run": root / "run"}


def _copy_run(ws, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(ws["run"], run)
    return run


def _flip(path: Path) -> None:
    """One bit in the middle of the file: inside a tensor's bytes, which torch.load reads without a word."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def _main(argv, capsys, monkeypatch):
    from megafixed import cli

    monkeypatch.delenv("MEGAFIXED_TRACEBACK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[20")]  # deepspeed's log lines
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------------- every reader verifies
READERS = {
    "eval": lambda ws, run, out: ["eval", run, "--text", ws["text"], "--tokenizer", ws["tok"], "--no-progress"],
    "export": lambda ws, run, out: ["export", "hf", run, out, "--tokenizer", ws["tok"]],
    "generate": lambda ws, run, out: ["generate", run, "--prompt", "the river", "--tokenizer", ws["tok"],
                                      "--max-new-tokens", "2"],
    "convert": lambda ws, run, out: ["convert", run / "checkpoints", out],
    "convert-plain": lambda ws, run, out: ["convert", run / "checkpoints", out, "--plain"],
    "probe": lambda ws, run, out: ["probe", run, "--tokens", "64"],
}


@pytest.mark.parametrize("verb", sorted(READERS))
def test_a_flipped_byte_in_the_weights_is_refused_by_every_reader(ws, tmp_path, capsys, monkeypatch, verb):
    run = _copy_run(ws, tmp_path)
    victim = run / "checkpoints" / TAG4 / MODEL
    _flip(victim)
    out = tmp_path / "out"
    rc, _, err = _main(READERS[verb](ws, run, out), capsys, monkeypatch)
    line = _one_error(err)
    assert rc == 2, err
    assert str(victim) in line and "sha256 differs" in line and "earlier tag" in line, line
    assert not out.exists()


def test_ckpt_inspect_and_universal_conversion_refuse_a_damaged_optimizer_file(ws, tmp_path, capsys, monkeypatch):
    run = _copy_run(ws, tmp_path)
    victim = run / "checkpoints" / TAG4 / OPTIM
    _flip(victim)
    rc, out, _ = _main(["ckpt", "inspect", run], capsys, monkeypatch)
    assert rc == 1 and str(victim) in out and "NOT verified" in out
    rc, _, err = _main(["convert", run / "checkpoints", "--universal"], capsys, monkeypatch)
    assert rc == 2 and str(victim) in _one_error(err)
    assert not (run / "checkpoints" / TAG4 / "universal").exists()


def test_init_from_a_damaged_checkpoint_is_refused_before_any_engine_work(ws, tmp_path):
    from types import SimpleNamespace

    from megafixed.config import load_config
    from megafixed.train.checkpoint import CheckpointError
    from megafixed.train.init_from import load_initial_weights

    run = _copy_run(ws, tmp_path)
    _flip(run / "checkpoints" / TAG4 / MODEL)
    cfg = load_config(str(run / "config.yaml"), [f"train.run_dir={tmp_path / 'new'}", f"train.init_from={run}"])
    topo = SimpleNamespace(is_main=True, tp=1, pp=1, tp_rank=0)
    with pytest.raises(CheckpointError, match=rf"{MODEL}.*sha256 differs"):
        load_initial_weights(None, cfg, topo)  # the engine is never touched
    assert not (tmp_path / "new" / ".init_from").exists()


def test_a_run_record_without_its_manifest_is_refused_by_readers_and_resume(ws, tmp_path, capsys, monkeypatch):
    run = _copy_run(ws, tmp_path)
    tag_dir = run / "checkpoints" / TAG4
    (tag_dir / "manifest.json").unlink()
    _flip(tag_dir / MODEL)  # what the missing manifest would have caught
    rc, _, err = _main(READERS["eval"](ws, run, None), capsys, monkeypatch)
    line = _one_error(err)
    assert rc == 2 and "run record (run.json) but no manifest.json" in line and str(tag_dir) in line, line
    rc, out, _ = _main(["ckpt", "inspect", run], capsys, monkeypatch)
    assert rc == 1 and "but no manifest.json" in out
    before = (run / "metrics.jsonl").read_bytes()
    proc = subprocess.run(_cmd(ws["shards"], run, "train.max_steps=6"), cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2 and "but no manifest.json" in _one_error(proc.stderr), proc.stderr[-3000:]
    assert (run / "metrics.jsonl").read_bytes() == before
    assert (run / "checkpoints" / "latest").read_text() == TAG4 + "\n"


def test_a_checkpoint_without_records_is_read_with_one_warning(ws, tmp_path, capsys, monkeypatch):
    run = _copy_run(ws, tmp_path)
    for name in ("manifest.json", "run.json"):
        (run / "checkpoints" / TAG4 / name).unlink()
    rc, out, err = _main(READERS["eval"](ws, run, None), capsys, monkeypatch)
    assert rc == 0 and "bits per byte" in out, err
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "no manifest.json" in warnings[0] and TAG4 in warnings[0], err


def test_an_import_without_its_manifest_is_refused(tmp_path):
    from megafixed.run import manifest
    from megafixed.train.checkpoint import CheckpointError

    tag = tmp_path / "imported"
    tag.mkdir()
    (tag / "run.json").write_text(json.dumps({"config": {}, "imported_from": "/models/llama", "format": 1}))
    with pytest.raises(CheckpointError, match="run record"):  # a current import always has its manifest
        manifest.verify_for_reading(tag)


def test_convert_writes_a_manifest_and_run_record_that_inspect_and_readers_verify(ws, tmp_path, capsys, monkeypatch):
    out = tmp_path / "converted"
    rc, _, err = _main(["convert", ws["run"] / "checkpoints", out], capsys, monkeypatch)
    assert rc == 0, err
    tag_dir = out / "converted"
    record = json.loads((tag_dir / "run.json").read_text())
    assert record["layout"]["tp"] == 1 and record["config"]["model"]["vocab_size"] == 320
    assert record["converted_from"].endswith(TAG4)
    rc, text, _ = _main(["ckpt", "inspect", out, "--json"], capsys, monkeypatch)
    info = json.loads(text)
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert rc == 0 and info["manifest"] == {"ok": True, "problem": None}
    assert info["git_revision"] == (rev or "unknown") and info["git_revision"] != "unknown" or not rev
    assert info["step"] == 4 and info["code"]["input"] == "canonical" and info["tag"] == "converted"
    rc, _, err = _main(["eval", tag_dir, "--text", ws["text"], "--tokenizer", ws["tok"], "--no-progress"], capsys,
                       monkeypatch)
    assert rc == 0 and "warning" not in err, err
    _flip(tag_dir / MODEL)
    rc, _, err = _main(["eval", tag_dir, "--text", ws["text"], "--tokenizer", ws["tok"]], capsys, monkeypatch)
    assert rc == 2 and "sha256 differs" in _one_error(err)


# ----------------------------------------------------------------------------------- one writer
def test_resume_loads_the_tag_it_was_given_not_a_moved_latest(ws, tmp_path):
    from types import SimpleNamespace

    from megafixed.config import load_config
    from megafixed.train.checkpoint import Checkpointer, ResumePoint, RunIdentity

    run = _copy_run(ws, tmp_path)
    point = ResumePoint(tag=TAG2, tag_dir=run / "checkpoints" / TAG2)  # what the resume read and verified
    (run / "checkpoints" / "latest").write_text(TAG4 + "\n")  # another process moved it after we read TAG2
    seen = []

    class Engine:
        def load(self, tag_dir, relayout=False):
            seen.append(tag_dir.name)
            return {"rng": []}

    cfg = load_config(str(run / "config.yaml"), [f"train.run_dir={run}"])
    plan = SimpleNamespace(tp=1, pp=1, dp=1, engine_plan=SimpleNamespace(zero_stage=cfg.zero.stage),
                           precision="fp32")  # a RunPlan's layout
    topo = SimpleNamespace(rank=0, world_size=1, tp=1, pp=1, dp=1, is_main=True, plan=plan)
    Checkpointer(cfg, topo, RunIdentity.of(cfg, plan)).load(Engine(), point)
    assert seen == [TAG2]


def _lock(path, **kw):
    from megafixed.run.run_dir import RunDirectory
    return RunDirectory(path).lock(**kw)


def test_run_lock_refuses_a_second_holder_naming_it_and_releases_only_its_own(tmp_path):
    from megafixed.run.run_lock import RunDirectoryBusy

    with _lock(tmp_path) as first:
        assert json.loads((tmp_path / ".megafixed.lock").read_text())["pid"] == os.getpid()
        with pytest.raises(RunDirectoryBusy, match=rf"in use by another trainer \(host {socket.gethostname()}, "
                                                   rf"pid {os.getpid()}, since 20\d\d-"):
            _lock(tmp_path).acquire()
        assert first.info is not None
    assert not (tmp_path / ".megafixed.lock").exists()  # released
    other = _lock(tmp_path).acquire()
    foreign = {"host": "elsewhere", "pid": 1, "start": None, "since": "then"}
    (tmp_path / ".megafixed.lock").write_text(json.dumps(foreign))  # replaced by hand: not ours any more
    other.release()
    assert json.loads((tmp_path / ".megafixed.lock").read_text()) == foreign


def test_run_lock_is_stale_once_its_holder_is_gone(tmp_path):
    from megafixed.run.run_lock import RunDirectoryBusy

    lock = tmp_path / ".megafixed.lock"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "start": "1", "since": "x"}))
    with _lock(tmp_path):  # same host, pid gone: taken at once
        pass
    # a live pid whose start time differs is a reused pid, not the holder
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "start": "0", "since": "x"}))
    with _lock(tmp_path):
        pass
    # another host: only the heartbeat (mtime) tells; fresh is held, old is stale
    lock.write_text(json.dumps({"host": "node-b", "pid": 4242, "start": "9", "since": "2026-01-01T00:00:00Z"}))
    with pytest.raises(RunDirectoryBusy, match=r"host node-b, pid 4242.*stale 10 minutes after its last heartbeat"):
        _lock(tmp_path).acquire()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with _lock(tmp_path) as taken:
        assert taken.info["pid"] == os.getpid()


def test_under_slurm_a_lock_of_an_earlier_incarnation_or_an_ended_job_is_stale_at_once(tmp_path, monkeypatch):
    from megafixed.run.run_lock import RunDirectoryBusy

    lock = tmp_path / "run" / ".megafixed.lock"
    lock.parent.mkdir()
    held = {"host": "node-b", "pid": 4242, "start": "9", "since": "x", "slurm_job_id": "77", "slurm_restart": 0}
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    lock.write_text(json.dumps(held))  # the same incarnation (a second srun in the job): held
    with pytest.raises(RunDirectoryBusy, match=r"pid 4242, Slurm job 77, since x"):
        _lock(lock.parent).acquire()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued after a hard kill, on another node
    with _lock(lock.parent) as taken:
        assert taken.info["slurm_restart"] == 1
        assert taken.took_over == "host node-b, pid 4242, Slurm job 77, since x: left by an earlier run of Slurm job 77"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    for state, stale in (("RUNNING", False), ("", True)):
        squeue.write_text(f"#!/bin/sh\necho '{state}'\n")
        squeue.chmod(0o755)
        lock.write_text(json.dumps(held))  # job 77's, fresh mtime
        if stale:
            with _lock(lock.parent):
                pass
        else:
            with pytest.raises(RunDirectoryBusy, match="Slurm job 77"):
                _lock(lock.parent).acquire()


def _slurm_job_on(monkeypatch, tmp_path, nodes: list[str], job="77", restart="0") -> Path:
    """This process as a task of Slurm job ``job`` on ``nodes[0]``; a stand-in ``scontrol`` expands the job's
    node list (records what it was asked); returns the file of its calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "scontrol.calls"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n" + "".join(f"echo {n}\n" for n in nodes))
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_RESTART_COUNT", restart)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[2-3]")
    monkeypatch.setenv("SLURMD_NODENAME", nodes[0])
    return calls


def test_under_slurm_a_lock_of_this_job_on_a_node_it_no_longer_has_is_stale_at_once(tmp_path, monkeypatch):
    """A lost head node: the job went on (same incarnation) on node2 + node3; its lock on node1 cannot be held."""
    from megafixed.run.run_lock import RunDirectoryBusy

    calls = _slurm_job_on(monkeypatch, tmp_path, ["node2", "node3"])
    lock = tmp_path / "run" / ".megafixed.lock"
    lock.parent.mkdir()
    held = {"host": "node1", "pid": 4242, "start": "9", "since": "x", "slurm_job_id": "77", "slurm_restart": 0,
            "slurm_node": "node1"}
    lock.write_text(json.dumps(held))  # a fresh heartbeat: only the node list tells
    with _lock(lock.parent) as taken:
        assert taken.took_over == ("host node1, pid 4242, Slurm job 77, since x: its node node1 is not one of "
                                   "Slurm job 77's nodes (node2, node3)")
        assert (taken.info["slurm_job_id"], taken.info["slurm_node"]) == ("77", "node2")
    assert calls.read_text().splitlines() == ["show hostnames node[2-3]"]  # Slurm's own expansion of the list
    # a lock of this job on one of its nodes is respected (a second srun of the job, a live rank 0 there)
    lock.write_text(json.dumps({**held, "host": "node3", "slurm_node": "node3"}))
    with pytest.raises(RunDirectoryBusy, match=r"host node3, pid 4242, Slurm job 77, since x"):
        _lock(lock.parent).acquire()
    # a record without slurm_node (an older megafixed) is judged by its hostname, qualified or not
    for host, stale in (("node1.cluster.example", True), ("node3.cluster.example", False)):
        lock.write_text(json.dumps({k: v for k, v in {**held, "host": host}.items() if k != "slurm_node"}))
        if stale:
            with _lock(lock.parent):
                pass
        else:
            with pytest.raises(RunDirectoryBusy, match=host):
                _lock(lock.parent).acquire()
    # another job's lock on a node this job does not have says nothing of that job: squeue decides
    squeue = tmp_path / "bin" / "squeue"
    squeue.write_text("#!/bin/sh\necho RUNNING\n")
    squeue.chmod(0o755)
    lock.write_text(json.dumps({**held, "slurm_job_id": "76"}))
    with pytest.raises(RunDirectoryBusy, match="Slurm job 76"):
        _lock(lock.parent).acquire()


def test_the_trainer_says_it_took_over_the_lock_of_a_node_the_job_no_longer_has(tmp_path, monkeypatch):
    """The one line the trainer prints for a lock it took over, through its real ``train`` (the training itself,
    which the lock only wraps, stands aside)."""
    from types import SimpleNamespace

    from megafixed.train import trainer

    _slurm_job_on(monkeypatch, tmp_path, ["node2", "node3"], restart="1")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".megafixed.lock").write_text(json.dumps({"host": "node1", "pid": 4242, "start": "9", "since": "x",
                                                     "slurm_job_id": "77", "slurm_restart": 1,
                                                     "slurm_node": "node1"}))
    seen = []
    monkeypatch.setattr(trainer, "_train", lambda cfg, topo, **kw: seen.append(json.loads(
        (run / ".megafixed.lock").read_text())) or "trained")
    lines = []
    from megafixed.config import load_config

    cfg = load_config(None, [f"train.run_dir={run}"])
    assert trainer.train(cfg, SimpleNamespace(is_main=True, rank=0), log=lines.append) == "trained"
    assert lines == [f"took over the run directory lock {run / '.megafixed.lock'} of a trainer that is gone (host "
                     f"node1, pid 4242, Slurm job 77, since x: its node node1 is not one of Slurm job 77's nodes "
                     f"(node2, node3))"]
    assert seen[0]["pid"] == os.getpid() and seen[0]["slurm_node"] == "node2"  # ours while it trained
    assert not (run / ".megafixed.lock").exists()  # released at the end


def test_the_holder_heartbeat_keeps_its_lock_fresh(tmp_path):
    lock = tmp_path / ".megafixed.lock"
    with _lock(tmp_path, heartbeat_s=0.05):
        old = time.time() - 3600
        os.utime(lock, (old, old))
        deadline = time.monotonic() + 300  # a bound for a hang: the next beat refreshes it, however late it runs
        while time.monotonic() < deadline and time.time() - lock.stat().st_mtime > 60:
            time.sleep(0.05)
        assert time.time() - lock.stat().st_mtime < 60


@pytest.mark.multiprocess
def test_a_second_trainer_on_a_running_run_dir_is_refused_and_the_first_keeps_its_metrics(ws, tmp_path):
    from _pause import ended, pause_env, wait_paused

    run = tmp_path / "run"
    cmd = _cmd(ws["shards"], run, "train.max_steps=100", "checkpoint.interval=1000")
    log = open(tmp_path / "first.err", "w+")  # a file, not a pipe: a full pipe would stall the trainer
    paused = tmp_path / "first.paused"  # the first stops before step 3 (2 steps logged) until its TERM
    first = subprocess.Popen(cmd, cwd=ROOT, env={**_env(), **pause_env("train.step@3", paused)},
                             stdout=subprocess.DEVNULL, stderr=log, text=True)

    def first_err():
        log.flush()
        return (tmp_path / "first.err").read_text()[-3000:]
    try:
        wait_paused(paused, ended(first, tmp_path / "first.err"))
        second = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        line = _one_error(second.stderr)
        assert second.returncode == 2, second.stderr
        assert f"host {socket.gethostname()}, pid {first.pid}, since 20" in line and str(run) in line, line
        assert first.poll() is None  # the first one never noticed
        first.send_signal(signal.SIGTERM)  # a clean stop: save, exit 75
        assert first.wait(timeout=300) == 75, first_err()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        log.close()
    steps = [r["step"] for r in read_metrics(run, "loss")]
    last = int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert steps == list(range(1, last + 1)) and last >= 2  # every step once, in order, up to the checkpoint
    assert not (run / ".megafixed.lock").exists()


# ----------------------------------------------------------------------------------- faults named
@pytest.fixture
def small_tmpfs(ws, tmp_path):
    """A tmpfs with room for one checkpoint of the tiny run but not two (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the full-disk test runs as root in CI)")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    one = sum(p.stat().st_size for p in (ws["run"] / "checkpoints" / TAG2).iterdir())
    size = (int(one * 1.5) // 4096 + 1) * 4096
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_during_a_save_is_named_and_keeps_the_previous_checkpoint(ws, small_tmpfs, mode):
    from megafixed.run import manifest
    from megafixed.train.evaluate import trained_state_dict

    run = small_tmpfs / "run"
    extra = ("checkpoint.async_save=true",) if mode == "async" else ()
    proc = subprocess.run(_cmd(ws["shards"], run, *extra), cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    line = _one_error(proc.stderr)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "no space left on device" in line and str(run / "checkpoints" / TAG4) in line, line
    assert "a checkpoint needs about" in line and f"the size of {TAG2}" in line and "is free there" in line, line
    assert f"`latest` still names {TAG2}" in line and "partial step_00000004 was removed" in line, line
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == TAG2 and not (ckpt / TAG4).exists()
    assert manifest.verify_for_reading(ckpt / TAG2)["step"] == 2
    assert "blocks.0.attn.qkv.weight" in trained_state_dict(ckpt, TAG2) or len(trained_state_dict(ckpt, TAG2)) > 4


def test_a_torch_zip_writer_error_is_mapped_to_the_filesystem_cause(tmp_path, monkeypatch):
    import errno

    from megafixed.run import save_faults

    ro = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    ro.__context__ = OSError(errno.ENOSPC, "No space left on device")
    assert save_faults.filesystem_errno(ro, tmp_path) == errno.ENOSPC
    bare = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    monkeypatch.setattr(save_faults, "_probe", lambda d: errno.EROFS)  # what the filesystem answers now
    assert save_faults.filesystem_errno(bare, tmp_path) == errno.EROFS
    assert save_faults.filesystem_errno(RuntimeError("shape mismatch"), tmp_path) is None
    (tmp_path / "step_00000004").mkdir()
    err = save_faults.named(PermissionError(errno.EACCES, "Permission denied"), tmp_path, "step_00000004", True)
    assert isinstance(err, save_faults.CheckpointSaveError) and "permission denied" in str(err)
    assert not (tmp_path / "step_00000004").exists()


# ----------------------------------------------------------------------------------- submit refuses now
def _submit(ws, run, *flags, over=()):
    return ["submit", "/dev/null", *tiny_overrides(ws["shards"], run, *EXTRA, *over), "--gpus-per-node", "1", "--cpu",
            "--dry-run", *flags]


def test_submit_refuses_a_signal_lead_not_below_the_time_limit(ws, tmp_path, capsys, monkeypatch):
    rc, _, err = _main(_submit(ws, tmp_path / "r", "--time", "00:02:00", "--signal-before", "600"), capsys,
                       monkeypatch)
    assert rc == 2 and "--signal-before 600 is not below --time 00:02:00 (120 s)" in _one_error(err)
    rc, out, err = _main(_submit(ws, tmp_path / "r", "--time", "1-00", "--signal-before", "600"), capsys,
                         monkeypatch)
    assert rc == 0 and "#SBATCH" in out, err


@pytest.mark.parametrize("dry", [True, False])
def test_submit_refuses_a_run_dir_whose_checkpoint_does_not_fit_the_new_config(ws, tmp_path, capsys, monkeypatch,
                                                                                 dry):
    argv = _submit(ws, ws["run"], over=["model.d_model=96"])
    if not dry:
        argv.remove("--dry-run")
        monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch: it must not get that far
    rc, _, err = _main(argv, capsys, monkeypatch)
    line = _one_error(err)
    assert rc == 2 and "model.d_model changed from 64 to 96" in line and TAG4 in line, line
    assert not (ws["run"] / "slurm").exists()
