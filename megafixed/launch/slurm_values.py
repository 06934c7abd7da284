"""What may go into a ``#SBATCH`` line: Slurm's own character set, nothing a shell or sbatch would read twice.

``#SBATCH`` lines are comments to bash but options to sbatch, which splits them at whitespace and
strips quotes; a value with a newline would end the line and put the rest in the script body, where
bash runs it. So each value we write there is checked against what Slurm itself accepts for it, and
refused with one line naming the option otherwise (the caller's error class: exit 2). Values that
also reach a bash line are ``shlex.quote``d there besides.
"""
from __future__ import annotations

import re
from typing import Optional

# Slurm names (partitions, accounts, QOS, job names): letters, digits and ``_ . - +``. A partition
# or QOS may be a comma-separated list (``--partition=a,b``: the first that can start the job).
_NAME = r"[A-Za-z0-9_.+-]+"
# fullmatch, never ``$``: ``$`` also matches before a final newline, the very character to keep out.
NAME = re.compile(_NAME)
NAME_LIST = re.compile(rf"{_NAME}(,{_NAME})*")
TIME = re.compile(r"(\d+-)?\d{1,2}(:\d{2}){0,2}|\d+")  # Slurm's --time forms: MM, HH:MM:SS, D-HH[:MM[:SS]]
# A path sbatch carries as is: no whitespace or control character (ends the option or the line), no quote
# or backslash (sbatch strips them), no ``%`` (a filename pattern in --output, e.g. %j).
_PATH_BAD = re.compile(r"[\s\x00-\x1f\x7f\"'\\%]")


_LISTED_BY = {"partition": "sinfo -s", "account": "sacctmgr show assoc user=$USER", "qos": "sacctmgr show qos"}


def name_problem(flag: str, value: Optional[str], lists: bool = False) -> Optional[str]:
    """Why ``value`` cannot be written as ``#SBATCH --<flag>=value`` (None when it can, or is unset)."""
    if value is None or value == "":
        return None
    if (NAME_LIST if lists else NAME).fullmatch(value):
        return None
    allowed = "letters, digits and _ . - +" + (" (a list: comma-separated)" if lists else "")
    where = _LISTED_BY.get(flag)
    return (f"--{flag} {value!r} holds characters a Slurm {flag} name cannot have; use {allowed}"
            + (f", as `{where}` spells it" if where else ""))


def time_problem(value: Optional[str]) -> Optional[str]:
    if value is None or TIME.fullmatch(value):
        return None
    return f"--time {value!r} is not a Slurm time limit; use HH:MM:SS or D-HH:MM:SS"


def path_problem(what: str, path: str, fix: str) -> Optional[str]:
    """Why ``path`` cannot be carried by an ``#SBATCH`` line (``fix``: how to choose another)."""
    bad = _PATH_BAD.search(path)
    if bad is None:
        return None
    return (f"the {what} {path!r} contains {bad.group()!r}, which #SBATCH lines cannot carry (whitespace, a "
            f"control character, a quote, a backslash or %); {fix}")


def first_problem(*problems: Optional[str]) -> Optional[str]:
    return next((p for p in problems if p), None)


def check_options(error: type, partition: Optional[str] = None, account: Optional[str] = None,
                  qos: Optional[str] = None, time: Optional[str] = None,
                  job_name: Optional[str] = None) -> None:
    """Raise ``error`` (one line) for the first value that is not Slurm's to take."""
    problem = first_problem(name_problem("partition", partition, lists=True), name_problem("account", account),
                            name_problem("qos", qos, lists=True), time_problem(time),
                            name_problem("job-name", job_name))
    if problem:
        raise error(problem)
