"""What a shared config or a wrapper can put into a job script: every value bash reads is quoted, every
#SBATCH value is Slurm's to take, and running the script with stub Slurm tools runs no payload."""
from __future__ import annotations

import argparse
import os
import stat
import subprocess

import pytest

from megafixed.commands import preprocess_submit
from megafixed.data.errors import DataError
from megafixed.launch.sbatch import JobSpec, render
from megafixed.launch.world import LaunchError

# ${IFS}: a run dir with whitespace is refused outright (#SBATCH lines cannot carry it)
PAYLOADS = [";touch${IFS}PWNED;", "$(touch${IFS}PWNED)", "`touch${IFS}PWNED`", "|touch${IFS}PWNED&"]


def _spec(tmp_path, **kw) -> JobSpec:
    base = dict(config="/c/cfg.yaml", overrides=["train.max_steps=5"], run_dir=str(tmp_path / "run"), nodes=2,
                gpus_per_node=2, cpu=True, python="/venv/bin/python", workdir=str(tmp_path), time="01:00:00")
    return JobSpec(**{**base, **kw})


def _stubs(tmp_path) -> dict:
    """srun, scontrol, sbatch and python stand-ins: srun exits 77 (a node left after transient faults) so the
    script takes the path that reads the run dir; nothing they do creates a file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {"srun": "exit 77", "scontrol": 'case "$1" in show) echo "Command=/x/job.sbatch";; esac; exit 0',
               "sbatch": "echo 1234", "python": "echo 127.0.0.1"}
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "MEGAFIXED_"))}
    return env | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "2",
                  "SLURM_JOB_ID": "42", "SLURM_CPUS_PER_TASK": "1"}


@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_run_dir_with_shell_syntax_is_quoted_and_never_runs(tmp_path, payload):
    work = tmp_path / "work"
    work.mkdir()
    run_dir = work / f"r{payload}"
    text = render(_spec(tmp_path, run_dir=str(run_dir), workdir=str(work), python="python",
                        overrides=[f"train.run_dir={run_dir}"]), submitted="T")
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    (run_dir / "faults").mkdir(parents=True)
    (run_dir / "faults" / "exclude_nodes.txt").write_text("n7\n")
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    out = subprocess.run(["bash", str(script)], cwd=work, env=_stubs(tmp_path), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 77, out.stderr
    assert "transient faults on n7; resubmitted as job 1234" in out.stdout  # the run dir's file was read
    made = [p for p in tmp_path.rglob("PWNED*")]
    assert made == [], made


@pytest.mark.parametrize("field, value, needle", [
    ("run_dir", "/r/x\ntouch /tmp/PWNED", "the run dir"),
    ("run_dir", "/r/with space", "the run dir"),
    ("run_dir", "/r/%j", "the run dir"),
    ("workdir", "/w/a\"b", "the working directory"),
    ("partition", "gpu\ntouch /tmp/PWNED", "--partition"),
    ("account", "acc\ntouch /tmp/PWNED", "--account"),
    ("qos", "high\n", "--qos"),
    ("partition", "gpu --exclusive", "--partition"),
    ("job_name", "a;b", "--job-name"),
    ("time", "1:00:00\n#SBATCH --exclusive", "--time"),
])
def test_values_a_job_script_cannot_carry_are_refused_with_one_line(tmp_path, field, value, needle):
    with pytest.raises(LaunchError) as err:
        render(_spec(tmp_path, **{field: value}))
    message = str(err.value)
    assert needle in message and "\n" not in message, message


def test_slurm_names_and_lists_pass_as_they_are(tmp_path):
    text = render(_spec(tmp_path, partition="gpu-a100,gpu_h100", account="proj.ai-1", qos="high", job_name="r1.v2"))
    for line in ("#SBATCH --partition=gpu-a100,gpu_h100", "#SBATCH --account=proj.ai-1", "#SBATCH --qos=high",
                 "#SBATCH --job-name=r1.v2"):
        assert line in text.splitlines(), line
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_the_cli_refuses_a_partition_with_a_newline_with_exit_2_and_one_line(tmp_path, capsys, monkeypatch):
    from megafixed.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    assert cli_main(["submit", str(cfg), "data.mock=true", f"train.run_dir={tmp_path / 'run'}", "--cpu",
                     "--gpus-per-node", "1", "--partition", "gpu\ntouch PWNED", "--dry-run"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1 and "--partition" in err[0] and "letters, digits" in err[0], err
    assert not (tmp_path / "run").exists()


def _preprocess_args(tmp_path, **kw):
    base = dict(partition=None, account=None, time=None, workers=1, nodes=1, output_prefix=str(tmp_path / "c"))
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("field, value", [("partition", "cpu\ntouch PWNED"), ("account", "a\n"),
                                          ("time", "01:00:00\nrm"), ("output_prefix", "/d/c\nx")])
def test_preprocess_submit_refuses_what_a_job_script_cannot_carry(tmp_path, field, value):
    args = _preprocess_args(tmp_path, **{field: value}, groups=None, overwrite=False, dry_run=True)
    with pytest.raises(DataError, match=field.replace("_", "-") if field != "time" else "--time"):
        preprocess_submit.submit(args, [])


def test_preprocess_scripts_quote_what_bash_reads_and_pass_bash_n(tmp_path, monkeypatch):
    work = tmp_path / "w$(touch${IFS}PWNED)"
    work.mkdir()
    monkeypatch.chdir(work)
    plan = str(work / "c`touch${IFS}PWNED`.plan.json")
    array, manifest = preprocess_submit.render(_preprocess_args(tmp_path, partition="cpu"), plan, [0, 1],
                                               str(work / "c.slurm"))
    for text in (array, manifest):
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
        assert "#SBATCH --partition=cpu" in text
