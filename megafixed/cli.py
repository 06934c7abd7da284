"""``megafixed <verb>``: one thin entry point; each verb lives in ``megafixed/commands/<verb>.py``.

Verb modules are imported lazily so that ``megafixed codes`` does not pay for DeepSpeed's import.
Each verb module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

VERBS = {
    "codes": "show the fixed code of some token ids (a quick look at the convention)",
    "tokenizer": "train or inspect a tokenizer",
    "preprocess": "tokenize corpora into Megatron .bin/.idx shards",
    "data": "inspect or merge token shards",
    "params": "count parameters of a config on the meta device",
    "train": "train a model (DeepSpeed engine; single process, torchrun or deepspeed launcher)",
    "plan": "list feasible TP/PP/DP/ZeRO layouts and their memory per GPU",
    "convert": "re-shard a checkpoint's weights for another TP/PP layout",
    "bench": "benchmarks (preprocessing throughput, kernels)",
    "quickstart": "the README's main job: tokenize the bundled corpus, train, evaluate",
}


def _module(verb: str):
    return importlib.import_module(f"megafixed.commands.{verb}")


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


def main(argv: list[str] | None = None) -> int:
    argv = _take_launcher_local_rank(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="megafixed", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    available = {}
    for verb, help_text in VERBS.items():
        try:
            mod = _module(verb)
        except ModuleNotFoundError as exc:
            if exc.name == f"megafixed.commands.{verb}":
                continue  # verb not built yet
            raise
        p = sub.add_parser(verb, help=getattr(mod, "HELP", help_text), description=getattr(mod, "HELP", help_text))
        mod.add_arguments(p)
        available[verb] = mod
    args = parser.parse_args(argv)
    if not args.verb:
        parser.print_help()
        return 2
    try:
        return int(available[args.verb].run(args) or 0)
    except BrokenPipeError:
        # `megafixed data inspect ... | head`: the reader left; that is not an error of ours.
        sys.stderr.close()
        return 0
    except (ValueError, OSError) as exc:
        # The project's errors (ConfigError, DataError, CodeError, ...) are ValueErrors whose message
        # names the problem and the fix; a traceback would bury it. MEGAFIXED_TRACEBACK=1 shows it.
        if os.environ.get("MEGAFIXED_TRACEBACK"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
