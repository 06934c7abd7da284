"""Issue 50 [trust], the checkpoint half: a checkpoint, a ``latest`` or a run directory from someone
else cannot run code, reach outside its place, or take a run over.

One tiny run per engine (2 steps, a checkpoint at 1 and 2) is trained once per module through the
real CLI; each test tampers a copy. The payload is a pickled object whose unpickling creates a
marker file (``pathlib.Path.touch``), and the manifest is rewritten to match (whoever can write
the files can rewrite it): every reading verb refuses in one line naming the file and the global,
exit 2, and the marker is never created. The genuine checkpoint still reads bit-identical to what
the unrestricted ``torch.load``/DCP reader gives.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _env import launch_free_env
from _train_data import tiny_overrides, write_shards

ROOT = Path(__file__).resolve().parent.parent
TAG1, TAG2 = "step_00000001", "step_00000002"
ENGINES = ("deepspeed", "torch")
EXTRA = ("model.input=canonical", "model.vocab_size=320", "model.code_bits=9", "train.max_steps=2",
         "checkpoint.interval=1", "validation.interval=0", "schedule.warmup_steps=1", "checkpoint.keep=0")
# the file every reader of each engine unpickles (a resume reads these too)
READ_BY_ALL = {"deepspeed": "mp_rank_00_model_states.pt", "torch": ".metadata"}
# what only a resume unpickles: DeepSpeed's optimizer partition, the torch engine's client state
READ_ON_RESUME = {"deepspeed": "zero_pp_rank_0_mp_rank_00_optim_states.pt", "torch": "client_state.pt"}


class Touch:
    """Unpickled, it creates ``path``: what an attacker's ``os.system`` would be, observably."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def _cmd(shards, run_dir, *extra):
    return [sys.executable, "-m", "megafixed.cli", "train", "/dev/null",
            *tiny_overrides(shards, run_dir, *EXTRA, *extra)]


def _env():
    env = launch_free_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.pop("MEGAFIXED_TRACEBACK", None)
    return env


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    from megafixed.data.tokenizers import train_tokenizer

    root = tmp_path_factory.mktemp("trust")
    shards = write_shards(root / "shards")
    text = root / "text.txt"
    text.write_text(" ".join(f"the river {i} flows north to the sea and back again." for i in range(200)) + "\n")
    tok = train_tokenizer([str(text)], str(root / "tokenizer.json"), 300)
    runs = {}
    for engine in ENGINES:
        run = root / f"run_{engine}"
        proc = subprocess.run(_cmd(shards, run, f"train.engine={engine}"), cwd=ROOT, env=_env(), capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        runs[engine] = run
    return {"root": root, "shards": shards, "tok": tok, "text": str(text), "runs": runs}


def _copy_run(ws, engine, tmp_path) -> Path:
    run = tmp_path / f"run_{engine}"
    shutil.copytree(ws["runs"][engine], run, symlinks=True)
    return run


def _rewrite_manifest(tag_dir: Path, name: str) -> None:
    """What an attacker does after changing ``name``: its size and sha256 in the manifest, to match."""
    path = tag_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    data = (tag_dir / name).read_bytes()
    for entry in manifest["files"]:
        if entry["name"] == name:
            entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    path.write_text(json.dumps(manifest, indent=1) + "\n")


def _plant(tag_dir: Path, name: str, marker: Path) -> None:
    """Add a payload to ``tag_dir/name``: an extra key (a torch.save file) or attribute (DCP's .metadata)."""
    path = tag_dir / name
    if name == ".metadata":
        with open(path, "rb") as fh:
            md = pickle.load(fh)  # our own genuine file
        md.__dict__["planted"] = Touch(marker)
        with open(path, "wb") as fh:
            pickle.dump(md, fh)
    else:
        state = torch.load(path, map_location="cpu", weights_only=False)  # our own genuine file
        state["planted"] = Touch(marker)
        torch.save(state, path)
    _rewrite_manifest(tag_dir, name)


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


def test_the_payload_really_runs_when_unpickled_without_restriction(tmp_path):
    """The tests below mean something: the planted object does create its file under a plain pickle.load."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Touch(marker)))
    assert marker.exists()


# ----------------------------------------------------------------------------------- every reading verb
READERS = {
    "eval": lambda ws, run, out: ["eval", run, "--text", ws["text"], "--tokenizer", ws["tok"], "--no-progress"],
    "export": lambda ws, run, out: ["export", "hf", run, out, "--tokenizer", ws["tok"]],
    "generate": lambda ws, run, out: ["generate", run, "--prompt", "the river", "--tokenizer", ws["tok"],
                                      "--max-new-tokens", "2"],
    "convert": lambda ws, run, out: ["convert", run / "checkpoints", out],
    "convert-plain": lambda ws, run, out: ["convert", run / "checkpoints", out, "--plain"],
    "ckpt-inspect": lambda ws, run, out: ["ckpt", "inspect", run],
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("verb", sorted(READERS))
def test_a_planted_pickle_is_refused_by_every_reader_and_never_runs(ws, tmp_path, capsys, monkeypatch, verb, engine):
    run = _copy_run(ws, engine, tmp_path)
    marker = tmp_path / "PWNED"
    victim = run / "checkpoints" / TAG2 / READ_BY_ALL[engine]
    _plant(victim.parent, victim.name, marker)
    out = tmp_path / "out"
    rc, _, err = _main(READERS[verb](ws, run, out), capsys, monkeypatch)
    line = _one_error(err)
    assert rc == 2, err
    assert str(victim) in line and "would import" in line and "nothing was loaded" in line, line
    assert "pathlib" in line or "builtins.getattr" in line, line  # the payload's global, named
    assert not marker.exists() and not out.exists()


@pytest.mark.parametrize("engine", ENGINES)
def test_the_genuine_checkpoint_reads_bit_identical_to_an_unrestricted_load(ws, tmp_path, engine):
    from megafixed.engine.weights import gather_state_dict

    tag_dir = ws["runs"][engine] / "checkpoints" / TAG2
    ours = gather_state_dict(tag_dir)
    if engine == "deepspeed":
        reference = torch.load(tag_dir / READ_BY_ALL[engine], map_location="cpu", weights_only=False)["module"]
    else:  # DCP's own single-file conversion, through pickle.load and weights_only=False
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(tag_dir, tmp_path / "all.pt")
        loaded = torch.load(tmp_path / "all.pt", weights_only=False)
        reference = loaded["model"] if isinstance(loaded.get("model"), dict) else {
            k[len("model."):]: v for k, v in loaded.items() if k.startswith("model.")}
    reference = {k: v for k, v in reference.items() if torch.is_tensor(v)}
    assert set(ours) == set(reference)
    for k, v in ours.items():
        assert v.dtype == reference[k].dtype and torch.equal(v, reference[k]), k


def test_our_client_state_loads_weights_only_equal_to_an_unrestricted_load(ws):
    from megafixed.trust.pickles import load_weights

    for path in (ws["runs"]["torch"] / "checkpoints" / TAG2 / "client_state.pt",
                 ws["runs"]["deepspeed"] / "checkpoints" / TAG2 / "mp_rank_00_model_states.pt"):
        safe = load_weights(path, map_location="cpu")
        full = torch.load(path, map_location="cpu", weights_only=False)
        assert repr(safe) == repr(full), path


# ----------------------------------------------------------------------------------- resume, init_from, rollback
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("which", ["read_by_all", "read_on_resume"])
def test_a_resume_refuses_a_planted_pickle_before_loading(ws, tmp_path, engine, which):
    run = _copy_run(ws, engine, tmp_path)
    marker = tmp_path / "PWNED"
    name = (READ_BY_ALL if which == "read_by_all" else READ_ON_RESUME)[engine]
    victim = run / "checkpoints" / TAG2 / name
    _plant(victim.parent, name, marker)
    before = (run / "metrics.jsonl").read_bytes()
    proc = subprocess.run(_cmd(ws["shards"], run, f"train.engine={engine}", "train.max_steps=3"), cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)
    line = _one_error(proc.stderr)
    assert proc.returncode == 2 and str(victim) in line and "would import" in line, proc.stderr[-3000:]
    assert not marker.exists()
    assert (run / "metrics.jsonl").read_bytes() == before
    assert (run / "checkpoints" / "latest").read_text() == TAG2 + "\n"


@pytest.mark.parametrize("engine", ENGINES)
def test_init_from_refuses_a_planted_pickle(ws, tmp_path, engine):
    src = _copy_run(ws, engine, tmp_path)
    marker = tmp_path / "PWNED"
    victim = src / "checkpoints" / TAG2 / READ_BY_ALL[engine]
    _plant(victim.parent, victim.name, marker)
    new = tmp_path / "new"
    proc = subprocess.run(_cmd(ws["shards"], new, f"train.engine={engine}", f"train.init_from={src}"), cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)
    line = _one_error(proc.stderr)
    assert proc.returncode == 2 and str(victim) in line and "would import" in line, proc.stderr[-3000:]
    assert not marker.exists() and not (new / "checkpoints").exists()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_rollback_refuses_a_planted_pickle(ws, tmp_path, engine):
    """The rollback's reload goes through ``fallback.newest_verified`` (``callbacks/guard/rollback.roll_back``), as
    the resume's does: a planted older tag is refused there, not passed over as damaged and not loaded."""
    from megafixed.run.run_dir import RunDirectory
    from megafixed.train.fallback import newest_verified
    from megafixed.trust import UntrustedCheckpoint

    run = _copy_run(ws, engine, tmp_path)
    marker = tmp_path / "PWNED"
    victim = run / "checkpoints" / TAG1 / READ_ON_RESUME[engine]
    _plant(victim.parent, victim.name, marker)
    rd = RunDirectory(run)
    with pytest.raises(UntrustedCheckpoint, match=str(victim)):
        newest_verified(rd, TAG2, rank=0, world=1, strict=False, below=True)
    assert newest_verified(rd, TAG2, rank=0, world=1, strict=False) == (TAG2, [])  # the clean newer tag loads
    assert not marker.exists()


def test_a_torch_save_with_a_newer_pickle_protocol_is_scanned_too(tmp_path):
    """Protocol 4+ spells a global as two strings and a STACK_GLOBAL (torch's own static reader stops there)."""
    from megafixed.trust.pickles import scan

    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "x": Touch(tmp_path / "PWNED")}, path, pickle_protocol=4)
    assert "pathlib.Path.touch" in scan(path) or "builtins.getattr" in scan(path)
    torch.save({"module": {"w": torch.ones(2)}}, path, pickle_protocol=4)
    assert scan(path) == []


# ----------------------------------------------------------------------------------- the allow-lists
def test_each_allow_list_was_read_from_the_installed_version():
    import deepspeed

    from megafixed.trust.allowlist import allow_lists

    installed = {"torch": torch.__version__.split("+")[0], "deepspeed": deepspeed.__version__}
    lists = allow_lists()
    assert {a.library for a in lists} >= {"torch", "deepspeed", "megafixed"}
    for a in lists:
        if a.library in installed:
            assert a.version == installed[a.library], (
                f"allowlists/{a.name}.json was read from {a.library} {a.version}, {installed[a.library]} is installed: "
                f"re-read what it writes (scan a fresh checkpoint) and update the list and its version")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_genuine_checkpoint_of_each_engine_scans_clean(ws, engine):
    from megafixed.trust.pickles import check_tag_dir, globals_in_file

    for tag in (TAG1, TAG2):
        check_tag_dir(ws["runs"][engine] / "checkpoints" / tag)
    # and the scan sees the library's own classes (so a clean scan is not an empty one)
    tag_dir = ws["runs"][engine] / "checkpoints" / TAG2
    seen = set().union(*(globals_in_file(p) for p in tag_dir.iterdir() if p.suffix == ".pt" or p.name == ".metadata"))
    expected = ("deepspeed.runtime.fp16.loss_scaler.LossScaler" if engine == "deepspeed"
                else "torch.distributed.checkpoint.metadata.Metadata")
    assert expected in seen, seen


# ----------------------------------------------------------------------------------- whose run directory
def _as_other_user(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        os.chown(p, 65534, 65534, follow_symlinks=False)


@pytest.mark.parametrize("how", ["other-owner", "world-writable", "group-writable-checkpoint"])
def test_a_run_directory_someone_else_can_write_is_refused_and_accepted_knowingly(ws, tmp_path, capsys, monkeypatch,
                                                                                  how):
    run = _copy_run(ws, "deepspeed", tmp_path)
    if how == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        _as_other_user(run)
        named, said = run, "is owned by"
    elif how == "world-writable":
        run.chmod(0o777)
        named, said = run, "writable by every user"
    else:
        named = run / "checkpoints" / TAG2
        named.chmod(0o775)
        if os.geteuid() == 0:
            os.chown(named, -1, 65534)  # a shared group (nogroup), not root's private one
        import grp
        import pwd

        if grp.getgrgid(named.stat().st_gid).gr_name == pwd.getpwuid(named.stat().st_uid).pw_name:
            pytest.skip("the directory's group is its owner's private group, which is accepted")
        said = "writable by its group"
    argv = READERS["eval"](ws, run, None)
    rc, _, err = _main(argv, capsys, monkeypatch)
    line = _one_error(err)
    assert rc == 2 and str(named) in line and said in line and "--trust-run-dir" in line, line
    rc, out, err = _main([*argv, "--trust-run-dir"], capsys, monkeypatch)
    assert rc == 0 and "bits per byte" in out, err
    # the trainer: refused before the lock or anything else, accepted with train.trust_run_dir=true
    before = (run / "metrics.jsonl").read_bytes()
    proc = subprocess.run(_cmd(ws["shards"], run, "train.max_steps=3"), cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=600)
    line = _one_error(proc.stderr)
    assert proc.returncode == 2 and str(named) in line and "train.trust_run_dir=true" in line, proc.stderr[-3000:]
    assert (run / "metrics.jsonl").read_bytes() == before and not (run / ".megafixed.lock").exists()
    proc = subprocess.run(_cmd(ws["shards"], run, "train.max_steps=3", "train.trust_run_dir=true"), cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000003\n"


def test_our_own_run_directory_is_accepted(ws):
    from megafixed.trust.owner import check_run_dir

    for engine in ENGINES:
        check_run_dir(ws["runs"][engine])


# ----------------------------------------------------------------------------------- names stay inside
@pytest.mark.parametrize("latest", ["../../elsewhere/step_00000002", "/etc", "other_tag", "step_00000002/.."])
def test_a_latest_naming_anything_but_a_tag_of_the_run_is_damage(ws, tmp_path, capsys, monkeypatch, latest):
    from megafixed.run.checkpoint_error import DamagedCheckpoint
    from megafixed.run.run_dir import read_latest

    run = _copy_run(ws, "deepspeed", tmp_path)
    ckpts = run / "checkpoints"
    (tmp_path / "elsewhere" / TAG2).mkdir(parents=True)
    (ckpts / "other_tag").mkdir()
    (ckpts / "latest").write_text(latest + "\n")
    with pytest.raises(DamagedCheckpoint, match="not a checkpoint tag of a run"):
        read_latest(ckpts)
    # convert takes DeepSpeed folders from elsewhere, whose tags may have any plain name, but no path
    for verb in ("generate", "convert") if "/" in latest else ("generate",):
        rc, _, err = _main(READERS[verb](ws, run, tmp_path / "out"), capsys, monkeypatch)
        line = _one_error(err)
        assert rc == 2 and "latest" in line and "which is not a checkpoint tag" in line, line
        assert not (tmp_path / "out").exists()
    # a resume falls back to the newest tag that verifies (checkpoint.fallback), saying so
    proc = subprocess.run(_cmd(ws["shards"], run, "train.max_steps=3"), cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "not a checkpoint tag of a run" in proc.stderr, proc.stderr[-3000:]
    assert json.loads((ckpts / "step_00000003" / "manifest.json").read_text())["step"] == 3
    assert (ckpts / "latest").read_text() == "step_00000003\n"


def test_a_latest_that_is_a_link_leading_out_is_damage(ws, tmp_path):
    from megafixed.run.checkpoint_error import DamagedCheckpoint
    from megafixed.run.run_dir import read_latest

    run = _copy_run(ws, "deepspeed", tmp_path)
    ckpts = run / "checkpoints"
    shutil.copytree(ckpts / TAG2, tmp_path / "elsewhere")
    (ckpts / "step_00000009").symlink_to(tmp_path / "elsewhere")
    (ckpts / "latest").write_text("step_00000009\n")
    with pytest.raises(DamagedCheckpoint, match="link leading outside"):
        read_latest(ckpts)


@pytest.mark.parametrize("name", ["../../../../../../etc/hostname", "/etc/hostname", "../step_00000001/run.json"])
def test_a_manifest_entry_outside_its_tag_directory_is_damage(ws, tmp_path, capsys, monkeypatch, name):
    from megafixed.run import manifest
    from megafixed.run.checkpoint_error import DamagedCheckpoint

    run = _copy_run(ws, "deepspeed", tmp_path)
    tag_dir = run / "checkpoints" / TAG2
    path = tag_dir / "manifest.json"
    data = json.loads(path.read_text())
    data["files"].append({"name": name, "size": 1, "sha256": "0" * 64})
    path.write_text(json.dumps(data))
    hashed, real = [], manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda p: hashed.append(p) or real(p))
    with pytest.raises(DamagedCheckpoint, match="outside the checkpoint directory") as caught:
        manifest.verify_for_reading(tag_dir)
    assert caught.value.why == "outside"
    assert not any("etc" in str(p) or TAG1 in str(p) for p in hashed), hashed  # nothing outside was opened
    monkeypatch.undo()
    rc, out, _ = _main(["ckpt", "inspect", run], capsys, monkeypatch)
    assert rc == 1 and "NOT verified" in out and "outside the checkpoint directory" in out
