#!/usr/bin/env python
"""Megatron-style entry point: same as ``megafixed preprocess`` (flags: --input, --json-keys,
--tokenizer, --output-prefix, --workers, --append-eod, --shard-size-mb, --strict, --code-bits)."""
import sys

from megafixed import cli

if __name__ == "__main__":
    # Through cli.main, so bad input is reported as one `error: ...` line like the verb itself.
    sys.exit(cli.main(["preprocess", *sys.argv[1:]]))
