"""megafixed: GPT pretraining with fixed token codes in place of a trainable input table."""
__version__ = "0.1.0"

# The code API is loaded on first use (PEP 562): importing the package must not import torch, because
# the CLI sets OpenMP's wait policy before torch loads OpenMP (megafixed/threads.py).
_LAZY = {"CodeError", "FixedCode", "bits_needed"}


def __getattr__(name):
    if name in _LAZY:
        from . import codes

        return getattr(codes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
