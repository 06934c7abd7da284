"""Moved: ``megafixed bench kernels`` lives in :mod:`megafixed.bench.kernels` (a sweep over shapes,
providers and modes). This name stays importable for scripts that used it."""
from megafixed.bench.kernels import HELP, add_arguments, run  # noqa: F401
