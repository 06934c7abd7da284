"""The zero-shot tasks, defined exactly as lm-evaluation-harness 0.4 defines them.

Each task turns one document (a dict in the standard Hugging Face field layout of its data set)
into the harness's loglikelihood requests: ``(context, continuation)`` string pairs, with the same
prompt templates, preprocessing, target delimiter (" ") and gold label. Sources, per task, in the
installed ``lm_eval`` package: ``tasks/hellaswag/{hellaswag.yaml,utils.py}``, ``tasks/piqa/piqa.yaml``,
``tasks/lambada/lambada_openai.yaml``, ``tasks/arc/arc_easy.yaml``, ``tasks/openbookqa/openbookqa.yaml``,
``tasks/commonsense_qa/default.yaml``, ``tasks/winogrande/{default.yaml,preprocess_winogrande.py}``,
``tasks/mmlu/default/_default_template_yaml`` (+ each subject's ``description``), and the prompt
assembly in ``api/task.py`` (``fewshot_context`` / ``build_qa_turn`` / ``construct_requests``).

We re-state the templates here (a few lines each) instead of running the harness's Jinja/YAML
machinery: ``megafixed eval`` then needs neither lm-eval nor ``datasets`` at run time, and the
equality test (tests/test_eval_equality.py) holds these definitions to the harness's output.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Optional

TARGET_DELIMITER = " "  # the harness default (``target_delimiter``)
FEWSHOT_DELIMITER = "\n\n"  # the harness default (``fewshot_delimiter``)


class TaskError(ValueError):
    """An unknown task name or an unsupported option; the message lists what is accepted."""


@dataclass
class Doc:
    """One document's requests: ``contexts[i] + continuations[i]`` is choice i's text."""

    contexts: list[str]
    continuations: list[str]
    gold: int
    choices: list[str]  # the harness's ``doc_to_choice`` strings (acc_norm divides by their length)


@dataclass
class Task:
    name: str
    kind: str  # "multiple_choice" | "loglikelihood" (LAMBADA)
    metrics: tuple[str, ...]  # in table order
    primary: str  # the metric the summary table shows
    build: Callable[[dict], Doc] = field(repr=False)
    required: tuple[str, ...] = ()  # fields a document must have
    description: Callable[[dict], str] = field(default=lambda doc: "", repr=False)
    fewshot_split: Optional[str] = None  # where --num-fewshot examples come from (first_n sampler)


# ----------------------------------------------------------------------------- templates
def _hellaswag_preprocess(text: str) -> str:
    """``tasks/hellaswag/utils.py:preprocess``: WikiHow bracket artifacts out."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def _mc(query: str, choices: list[str], gold: int) -> Doc:
    """A plain multiple-choice document: one context, each choice a continuation after " "."""
    return Doc([query] * len(choices), [TARGET_DELIMITER + c for c in choices], gold, list(choices))


def hellaswag(doc: dict) -> Doc:
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    query = _hellaswag_preprocess(doc["activity_label"] + ": " + ctx)
    return _mc(query, [_hellaswag_preprocess(e) for e in doc["endings"]], int(doc["label"]))


def piqa(doc: dict) -> Doc:
    return _mc(f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], int(doc["label"]))


def arc(doc: dict) -> Doc:
    choices = doc["choices"]
    return _mc(f"Question: {doc['question']}\nAnswer:", list(choices["text"]),
               list(choices["label"]).index(doc["answerKey"]))


def openbookqa(doc: dict) -> Doc:
    choices = doc["choices"]
    return _mc(doc["question_stem"], list(choices["text"]), list(choices["label"]).index(doc["answerKey"].lstrip()))


def commonsense_qa(doc: dict) -> Doc:
    t = doc["choices"]["text"]
    query = (f"Question: {doc['question'].strip()}\nA. {t[0]}\nB. {t[1]}\nC. {t[2]}\nD. {t[3]}\nE. {t[4]}\n"
             f"Answer:")
    letters = ["A", "B", "C", "D", "E"]
    return _mc(query, letters, letters.index(doc["answerKey"]))


def winogrande(doc: dict) -> Doc:
    """Partial scoring: the blank filled with each option is the *context*; the shared rest of the
    sentence is the continuation whose likelihood decides (``preprocess_winogrande.py``)."""
    idx = doc["sentence"].index("_")
    contexts = [doc["sentence"][:idx] + opt for opt in (doc["option1"], doc["option2"])]
    target = doc["sentence"][idx + 1:].strip()
    return Doc(contexts, [TARGET_DELIMITER + target] * 2, {"1": 0, "2": 1}[doc["answer"]], contexts)


def lambada(doc: dict) -> Doc:
    """lambada_openai: context = all but the last word; continuation = " " + last word (no extra
    delimiter: a ``loglikelihood`` task); acc = greedy decoding reproduces it."""
    words = doc["text"].split(" ")
    return Doc([" ".join(words[:-1])], [" " + words[-1]], 0, [words[-1]])


def mmlu_query(doc: dict) -> str:
    c = doc["choices"]
    return f"{doc['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"


def mmlu(doc: dict) -> Doc:
    return _mc(mmlu_query(doc), ["A", "B", "C", "D"], int(doc["answer"]))


def mmlu_description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {' '.join(subject.split('_'))}.\n\n"


# lm-eval's groups: mmlu -> {stem, other, social_sciences, humanities} -> subjects (tasks/mmlu/default/*.yaml
# "tag"); the group scores are size-weighted means with pooled standard errors, level by level.
MMLU_CATEGORIES = {
    "stem": "abstract_algebra anatomy astronomy college_biology college_chemistry college_computer_science "
            "college_mathematics college_physics computer_security conceptual_physics electrical_engineering "
            "elementary_mathematics high_school_biology high_school_chemistry high_school_computer_science "
            "high_school_mathematics high_school_physics high_school_statistics machine_learning".split(),
    "other": "business_ethics clinical_knowledge college_medicine global_facts human_aging management marketing "
             "medical_genetics miscellaneous nutrition professional_accounting professional_medicine "
             "virology".split(),
    "social_sciences": "econometrics high_school_geography high_school_government_and_politics "
                       "high_school_macroeconomics high_school_microeconomics high_school_psychology "
                       "human_sexuality professional_psychology public_relations security_studies sociology "
                       "us_foreign_policy".split(),
    "humanities": "formal_logic high_school_european_history high_school_us_history high_school_world_history "
                  "international_law jurisprudence logical_fallacies moral_disputes moral_scenarios philosophy "
                  "prehistory professional_law world_religions".split(),
}
MMLU_SUBJECTS = sorted(s for subjects in MMLU_CATEGORIES.values() for s in subjects)

_MC = ("acc", "acc_norm")
TASKS: dict[str, Task] = {
    "hellaswag": Task("hellaswag", "multiple_choice", _MC, "acc_norm", hellaswag,
                      ("activity_label", "ctx_a", "ctx_b", "endings", "label")),
    "piqa": Task("piqa", "multiple_choice", _MC, "acc_norm", piqa, ("goal", "sol1", "sol2", "label")),
    "lambada": Task("lambada", "loglikelihood", ("acc", "perplexity"), "acc", lambada, ("text",)),
    "arc_easy": Task("arc_easy", "multiple_choice", _MC, "acc_norm", arc, ("question", "choices", "answerKey")),
    "arc_challenge": Task("arc_challenge", "multiple_choice", _MC, "acc_norm", arc,
                          ("question", "choices", "answerKey")),
    "openbookqa": Task("openbookqa", "multiple_choice", _MC, "acc_norm", openbookqa,
                       ("question_stem", "choices", "answerKey")),
    "commonsense_qa": Task("commonsense_qa", "multiple_choice", ("acc",), "acc", commonsense_qa,
                           ("question", "choices", "answerKey")),
    "winogrande": Task("winogrande", "multiple_choice", ("acc",), "acc", winogrande,
                       ("sentence", "option1", "option2", "answer")),
}
for _s in MMLU_SUBJECTS:
    TASKS[f"mmlu_{_s}"] = Task(f"mmlu_{_s}", "multiple_choice", ("acc",), "acc", mmlu,
                               ("question", "choices", "answer"),
                               description=lambda doc, s=_s: mmlu_description(s), fewshot_split="dev")
ALIASES = {"lambada_openai": "lambada"}  # the harness's name for our `lambada`
GROUPS = {"mmlu": [f"mmlu_{s}" for s in MMLU_SUBJECTS]}
DEFAULT_TASKS = ("hellaswag", "piqa", "lambada", "arc_easy", "arc_challenge", "openbookqa", "commonsense_qa",
                 "winogrande", "mmlu")
# The harness's own task name for each of ours (the adapter test runs these).
HARNESS_NAME = {"lambada": "lambada_openai"}


def parse_tasks(spec: str | list[str]) -> list[str]:
    """``"hellaswag,mmlu"`` -> the group-expanded list, in order; an unknown name lists the known ones."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not names:
        raise TaskError("no task given; pass --tasks with one or more of: " + ", ".join(DEFAULT_TASKS))
    out: list[str] = []
    for name in names:
        name = ALIASES.get(name, name)
        members = GROUPS.get(name, [name])
        for m in members:
            if m not in TASKS:
                raise TaskError(f"--tasks: unknown task {name!r}; known tasks: {', '.join(DEFAULT_TASKS)} "
                                f"(and mmlu_<subject>, e.g. mmlu_anatomy)")
            if m not in out:
                out.append(m)
    return out


def category_of(task: str) -> Optional[str]:
    subject = task[len("mmlu_"):]
    return next((c for c, subjects in MMLU_CATEGORIES.items() if subject in subjects), None)


def fewshot_context(task: Task, doc: dict, examples: list[dict]) -> Doc:
    """The harness's prompt with ``examples`` as few-shot turns: description, then per example
    ``query + " " + gold choice + "\\n\\n"``, then the document's own query."""
    built = task.build(doc)
    prefix = task.description(doc)
    for ex in examples:
        e = task.build(ex)
        prefix += e.contexts[e.gold] + TARGET_DELIMITER + e.choices[e.gold] + FEWSHOT_DELIMITER
    if prefix:
        built.contexts = [prefix + c for c in built.contexts]
    return built
