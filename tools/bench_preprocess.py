#!/usr/bin/env python
"""Same as ``megafixed bench preprocess``: speed vs bare gigatoken / HF tokenizers, peak RSS vs corpus
size, as JSON (--out)."""
import argparse
import sys

from megafixed.data import bench_preprocess

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=bench_preprocess.HELP)
    bench_preprocess.add_arguments(parser)
    sys.exit(bench_preprocess.run(parser.parse_args()))
