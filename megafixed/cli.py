"""``megafixed <verb>``: one thin entry point; each verb lives in ``megafixed/commands/<verb>.py``.

Verb modules are imported lazily so that ``megafixed codes`` does not pay for DeepSpeed's import.
Each verb module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Every exception a verb raises goes through ``megafixed.errors.report`` (one ``error:`` line, the
exit code of ``megafixed.exit_codes``); argparse's complaints take the same path.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys

from . import threads

threads.set_wait_policy()  # before anything below imports torch (and with it OpenMP)
from . import errors  # noqa: E402

# What `megafixed --help` shows: written for users (the module docstring above is for developers).
DESCRIPTION = """\
megafixed trains GPT language models whose input is a fixed binary code per token instead of a
learned embedding table (DeepSpeed engine; tensor, pipeline and data parallelism).

New here? Start with `megafixed quickstart`: it tokenizes the bundled corpus, trains a small
model on CPU in a few minutes and evaluates it. Then: `tokenizer train` and `preprocess` turn
your corpus into shards, `params` and `plan` size a config, `train CONFIG` trains (and resumes).
`megafixed VERB --help` explains each verb. Commands never replace existing outputs unless
given --overwrite; set MEGAFIXED_TRACEBACK=1 to see the traceback behind an error."""


class _Parser(argparse.ArgumentParser):
    """argparse prints usage plus an error and exits; we raise so the error boundary prints one
    line like every other bad input (sub-parsers inherit this class)."""

    def error(self, message):
        if message.startswith("the following arguments are required:"):
            message = self._missing(message)
        raise errors.UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")

    def _missing(self, message: str) -> str:
        """Name what is missing with its help and the usage line. Python < 3.13 also lists a
        ``nargs="*"`` positional (``overrides``) as required when the one before it is absent: drop it."""
        names = [n.strip() for n in message.split(":", 1)[1].split(",")]
        optional = {a.dest for a in self._actions if a.nargs in ("*", "?")}
        optional |= {a.metavar for a in self._actions if a.nargs in ("*", "?") and a.metavar}
        names = [n for n in names if n not in optional] or names
        by_name = {(a.metavar or a.dest): a for a in self._actions}
        described = [f"{n} ({by_name[n].help})" if n in by_name and by_name[n].help else n for n in names]
        usage = re.sub(r"\s+", " ", self.format_usage()).strip()
        return f"the following arguments are required: {', '.join(described)}; {usage}"

    def _check_value(self, action, value):
        """A mistyped verb or sub-verb gets "did you mean" (argparse has it only from Python 3.14)."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError:
            choices = [c for c in (action.choices or ()) if isinstance(c, str)]
            close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6)
            if not close:
                raise
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}; did you mean {close[0]!r}? (choose "
                                                 f"from {', '.join(map(repr, choices))})") from None


# Each verb is a module of megafixed.commands with HELP, add_arguments(parser) and run(args).
VERBS = ("codes", "tokenizer", "preprocess", "data", "params", "train", "plan", "convert", "ckpt", "bench",
         "quickstart", "study", "probe", "submit", "eval", "export", "import", "generate")  # `megafixed --help` order
MODULES = {"import": "import_"}  # verbs whose module name differs (`import` is a Python keyword)


def _module(verb: str):
    return importlib.import_module(f"megafixed.commands.{MODULES.get(verb, verb)}")


def _take_launcher_local_rank(argv: list[str]) -> list[str]:
    """The ``deepspeed`` launcher inserts ``--local_rank=N`` *before* the verb; torch.distributed
    reads LOCAL_RANK from the environment, so move it there and drop the flag."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith(("--local_rank=", "--local-rank=")):
            os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
        elif a in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            i += 1
        else:
            out.append(a)
        i += 1
    return out


def build_parser(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, dict]:
    """The command line: the top parser and {verb: module}; every verb's parser without ``argv``
    (tests walk it to run every --help), else only the verb that ``argv`` names."""
    parser = _Parser(prog="megafixed", description=DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    available = {}
    # A named verb builds only its own parser: the others' imports (torch, DeepSpeed) would cost
    # `megafixed preprocess` seconds of start-up for nothing.
    chosen = [argv[0]] if argv and argv[0] in VERBS else VERBS
    for verb in chosen:
        mod = _module(verb)
        p = sub.add_parser(verb, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        available[verb] = mod
    return parser, available


def main(argv: list[str] | None = None) -> int:
    argv = _take_launcher_local_rank(sys.argv[1:] if argv is None else argv)
    parser, available = build_parser(argv)
    try:
        args, extra = parser.parse_known_args(argv)
        # `megafixed train CFG --dry-run a.b=1`: argparse stops filling a nargs="*" positional at
        # the first option, so overrides after an option arrive here; they are still overrides.
        if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
            args.overrides = list(args.overrides or []) + extra
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if not args.verb:
            parser.print_help()
            return 2
        return int(available[args.verb].run(args) or 0)
    except BrokenPipeError:
        # `megafixed data inspect ... | head`: the reader left; that is not an error of ours.
        sys.stderr.close()
        return 0
    except Exception as exc:  # one line naming the file/key and the fix; bugs keep their traceback
        return errors.report(exc)


def entry() -> None:
    """The console script and ``python -m megafixed.cli``: run the verb, then leave without the
    interpreter's teardown, where DeepSpeed's atexit hooks have been seen to SIGABRT after a
    finished run (turning a success into exit 134). Every file we write is closed by then."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
