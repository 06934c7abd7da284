"""``megafixed bench <what>``: benchmarks that write JSON; each lives beside the code it measures."""
from __future__ import annotations

import importlib

HELP = "benchmarks: 'preprocess' (tokenization throughput); more as they land"

# sub-benchmark -> module exposing add_arguments(parser) and run(args)
BENCHES = {"preprocess": "megafixed.data.bench_preprocess",
           "kernels": "megafixed.kernels.bench_token_codes",
           }


def add_arguments(p):
    sub = p.add_subparsers(dest="bench", metavar="WHAT", required=True)
    for name, mod in BENCHES.items():
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError:
            continue
        m.add_arguments(sub.add_parser(name, help=getattr(m, "HELP", name)))


def run(args) -> int:
    return int(importlib.import_module(BENCHES[args.bench]).run(args) or 0)
