"""`megafixed preprocess --submit` on the real one-node Slurm (tests/_slurm.py): a 3-task array, one
task killed mid-way, the manifest job refusing and naming the missing group, a rerun that redoes only
that group; the manifest's shards then equal a single-process run and train through data.prefixes.

Run with the other Slurm tests (`-n 0 -m slurm`), under `flock /tmp/megafixed-slurm.lock` when other
sessions may start the test Slurm too.
"""
from __future__ import annotations

import glob
import gzip
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from _pause import pause_env, wait_paused
from _slurm import start_cluster
from megafixed.data import BUNDLED_CORPUS
from megafixed.data.gpt_dataset import build_datasets
from megafixed.data.indexed import IndexedShard
from megafixed.data.prefixes import resolve_prefix
from megafixed.data.preprocess import PreprocessOptions, preprocess
from megafixed.data.tokenizers import train_tokenizer

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    found = start_cluster(tmp_path_factory.mktemp("slurm"))
    if isinstance(found, str):
        pytest.skip(found)
    found.env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    yield found
    found.stop()


def _submit(cluster, args, env=None) -> tuple[str, str | None, str]:
    out = subprocess.run([sys.executable, "-m", "megafixed.cli", "preprocess", *args], cwd=ROOT,
                         env={**cluster.env, **(env or {})}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout
    m = re.search(r"submitted array job (\d+|\(none[^)]*\)) and manifest job (\d+)", out.stdout)
    assert m, out.stdout
    array = m.group(1) if m.group(1).isdigit() else None
    return array, m.group(2), out.stdout


def _stream(prefixes):
    shards = [IndexedShard(p) for p in prefixes]
    return (np.concatenate([np.asarray(s.tokens) for s in shards]),
            np.concatenate([np.asarray(s.lengths) for s in shards]))


def test_array_with_a_killed_task_then_rerun_equals_one_process(cluster, tmp_path):
    with gzip.open(BUNDLED_CORPUS, "rb") as fh:
        lines = fh.read().splitlines(keepends=True)
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(4):  # four small files, then one big one: three groups [p0 p1 p2] [p3] [p4]
        (inputs / f"p{i}.jsonl").write_bytes(b"".join(lines[i * 500:(i + 1) * 500]))
    (inputs / "p4.jsonl").write_bytes(b"".join(itertools.chain(lines, lines)))
    tok = train_tokenizer([str(inputs / "p0.jsonl")], str(tmp_path / "tok.json"), 512)
    prefix = tmp_path / "out" / "c"
    args = ["--input", str(inputs / "p*.jsonl"), "--tokenizer", tok, "--output-prefix", str(prefix),
            "--submit", "--nodes", "3", "--time", "00:10:00", "--shard-size-mb", "2"]

    # group 2 stops after its first batch, written to its temporary shards, until its task is cancelled
    paused = tmp_path / "group2.paused"
    array, manifest_job, said = _submit(cluster, args, pause_env("preprocess.batch@1:group=2", paused))
    assert "to run: [0, 1, 2]" in said

    def gone():
        state = cluster.job_state(f"{array}_2").get("JobState")
        return f"finished too soon ({state})\n{cluster.logs()}" if state in ("COMPLETED", "FAILED") else None
    wait_paused(paused, gone)
    assert glob.glob(f"{prefix}_g00002.partial-*")  # group 2 has begun writing: kill it mid-way
    cluster.run("scancel", f"{array}_2")
    info = cluster.wait_for(manifest_job, {"COMPLETED", "FAILED"})
    assert info["JobState"] == "FAILED"  # it refuses with a group missing, and names it
    log = Path(f"{prefix}.slurm/manifest_{manifest_job}.out").read_text()
    assert re.search(r"error: no manifest written: group 2 \(p4\.jsonl\) has no completed shard", log), log
    assert not glob.glob(f"{prefix}_g00002*")  # the killed task left no half shard (nor temp files)
    assert not os.path.exists(f"{prefix}.manifest.json")
    kept = {p: os.stat(p).st_mtime_ns for p in glob.glob(f"{prefix}_g0000[01]*")}
    assert kept

    array2, manifest_job2, said = _submit(cluster, args)  # the same command again: redoes group 2 only
    assert "to run: [2]" in said and "skipped (complete and verified): [0, 1]" in said
    info = cluster.wait_for(manifest_job2, {"COMPLETED", "FAILED"})
    assert info["JobState"] == "COMPLETED", Path(f"{prefix}.slurm/manifest_{manifest_job2}.out").read_text()
    assert {p: os.stat(p).st_mtime_ns for p in glob.glob(f"{prefix}_g0000[01]*")} == kept  # not rewritten

    manifest = f"{prefix}.manifest.json"
    one = preprocess(PreprocessOptions([str(p) for p in sorted(inputs.glob("p*.jsonl"))], str(tmp_path / "one"),
                                       tok, progress=False))
    want_tokens, want_lengths = _stream(one.outputs["text"])
    got_tokens, got_lengths = _stream(resolve_prefix(manifest))
    assert np.array_equal(got_lengths, want_lengths) and np.array_equal(got_tokens, want_tokens)
    m = json.loads(Path(manifest).read_text())
    assert m["documents"] == one.documents and m["tokens"] == one.tokens and len(m["shards"]) > 3
    cfg = SimpleNamespace(prefixes=[manifest], weights=None, split="98,1,1", seq_len=64, cache_dir=None)
    ds = build_datasets(cfg, seed=0)  # data.prefixes takes the manifest as it is
    assert len(ds["train"]) > 0 and ds["train"][0].shape == (65,)
