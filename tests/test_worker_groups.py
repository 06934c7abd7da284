"""The suite's two-worker run (pytest.ini, tests/conftest.py) does what the suite's speed rests on: every test
of a file runs on one worker, the longest files start first, and the Slurm files are left out of it, to run
in their own invocation in one process (the README's test command and `.ci/run`).

A small suite of sleeping tests runs under the real conftest and pytest.ini in its own pytest; each test writes
down its file and worker, in the order the worker ran it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

TEST_FILE = '''
import json, os, time
import pytest

pytestmark = {marks}

@pytest.mark.parametrize("i", range({n}))
def test_sleep(i):
    time.sleep(0.05)
    with open(os.environ["GROUPS_LOG"], "a") as log:
        log.write(json.dumps(dict(file=__name__, worker=os.environ.get("PYTEST_XDIST_WORKER", "main"))) + "\\n")
'''

# the first two are conftest.LONGEST_FIRST's first two; the others are not in it, so they come after
LONGEST = ("test_fake_measure.py", "test_soak.py")
FILES = {"test_alpha.py": 5, "test_slurm.py": 2, "test_beta.py": 5, "test_preprocess_slurm.py": 2,
         "test_gamma.py": 5, LONGEST[1]: 3, LONGEST[0]: 3}
SLURM = ("test_slurm.py", "test_preprocess_slurm.py")
SLURM_COMMAND = "python -m pytest -q -n 0 -m slurm"


def _suite(tmp_path: Path) -> Path:
    for name, n in FILES.items():
        marks = "[pytest.mark.slurm, pytest.mark.multiprocess]" if name in SLURM else "[]"
        (tmp_path / name).write_text(TEST_FILE.replace("{n}", str(n)).replace("{marks}", marks))
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(ROOT / "pytest.ini", tmp_path / "pytest.ini")
    return tmp_path / "groups.jsonl"


def _pytest(tmp_path: Path, log: Path, *args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's worker
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**env, "GROUPS_LOG": str(log)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    log.unlink()
    return runs


def test_files_stay_on_one_worker_longest_first_and_slurm_runs_on_its_own(tmp_path):
    log = _suite(tmp_path)
    runs = _pytest(tmp_path, log)  # pytest.ini's options: -n 2 --dist loadfile, the Slurm files left out
    others = [name[:-3] for name in FILES if name not in SLURM]
    assert sorted(r["file"] for r in runs) == sorted(f for f in others for _ in range(FILES[f + ".py"])), \
        "the default run should run every file but the Slurm ones"

    def workers(*files):
        return {r["worker"] for r in runs if r["file"] in files}

    assert workers(*others) == {"gw0", "gw1"}, "both workers should have run tests"
    for name in others:
        assert len(workers(name)) == 1, f"{name}'s tests ran on {sorted(workers(name))}, not one worker"
    first = {next(r["file"] for r in runs if r["worker"] == w) for w in ("gw0", "gw1")}
    assert first == {name[:-3] for name in LONGEST}, f"the workers started with {sorted(first)}"

    slurm = _pytest(tmp_path, log, "-n", "0", "-m", "slurm")  # the Slurm files' own invocation
    assert sorted(r["file"] for r in slurm) == sorted(f[:-3] for f in SLURM for _ in range(FILES[f]))
    assert {r["worker"] for r in slurm} == {"main"}, "the Slurm files should run in one process"


def test_the_readme_and_ci_run_the_slurm_files_in_their_own_invocation():
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("pip install") and "[test]" in line)
    assert command.endswith(f"&& python -m pytest -q && {SLURM_COMMAND}"), command
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci.index(SLURM_COMMAND) == ci.index("python -m pytest -q") + 1, "`.ci/run` should run both"
