"""The suite's two-worker scheduling (tests/conftest.py) does what the suite's speed rests on: every test
of a file runs on one worker, all Slurm files on one, and the Slurm group with no other test beside it.

A small suite of sleeping tests runs under the real conftest in its own pytest, with `-n 2` and the
options of pytest.ini; each test writes down its file, worker and start/end times."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

TEST_FILE = '''
import json, os, time
import pytest

@pytest.mark.parametrize("i", range({n}))
def test_sleep(i):
    start = time.monotonic()
    time.sleep(0.15)
    with open(os.environ["GROUPS_LOG"], "a") as log:
        log.write(json.dumps(dict(file=__name__, worker=os.environ.get("PYTEST_XDIST_WORKER", "main"),
                                  start=start, end=time.monotonic())) + "\\n")
'''

# test_slurm.py and test_preprocess_slurm.py are two of conftest.SLURM_FILES: one group, run alone
FILES = {"test_alpha.py": 5, "test_slurm.py": 2, "test_beta.py": 5, "test_preprocess_slurm.py": 2,
         "test_gamma.py": 5}


def test_files_stay_on_one_worker_and_slurm_runs_alone(tmp_path):
    for name, n in FILES.items():
        (tmp_path / name).write_text(TEST_FILE.replace("{n}", str(n)))
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    log = tmp_path / "groups.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's worker
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                           "--no-loadscope-reorder", str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**env, "GROUPS_LOG": str(log)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == sum(FILES.values())

    def workers(*files):
        return {r["worker"] for r in runs if r["file"] in files}

    assert workers(*(name[:-3] for name in FILES)) == {"gw0", "gw1"}, "both workers should have run tests"
    for name in ("test_alpha", "test_beta", "test_gamma"):
        assert len(workers(name)) == 1, f"{name}'s tests ran on {sorted(workers(name))}, not one worker"
    assert len(workers("test_slurm", "test_preprocess_slurm")) == 1, "the Slurm files ran on two workers"
    slurm = [r for r in runs if "slurm" in r["file"]]
    others = [r for r in runs if "slurm" not in r["file"]]
    first, last = min(r["start"] for r in slurm), max(r["end"] for r in slurm)
    beside = [r for r in others if r["start"] < last and r["end"] > first]
    assert not beside, f"tests ran beside the exclusive Slurm group: {beside}"
