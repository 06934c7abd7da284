#!/usr/bin/env python
"""Same as ``megafixed bench kernels``: the fixed-code input vs embedding tables (JSON, CSV, PNG)."""
import argparse
import sys

from megafixed.bench import kernels

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=kernels.HELP)
    kernels.add_arguments(parser)
    sys.exit(kernels.run(parser.parse_args()))
