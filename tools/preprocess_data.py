#!/usr/bin/env python
"""Megatron-style entry point: same as ``megafixed preprocess`` (flags: --input, --json-keys,
--tokenizer, --output-prefix, --workers, --append-eod, --shard-size-mb, --strict, --code-bits)."""
import argparse
import sys

from megafixed.commands import preprocess

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=preprocess.HELP)
    preprocess.add_arguments(parser)
    sys.exit(preprocess.run(parser.parse_args()))
