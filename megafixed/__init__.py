"""megafixed: GPT pretraining with fixed token codes in place of a trainable input table."""
__version__ = "0.1.0"

from .codes import CodeError, FixedCode, bits_needed  # noqa: F401,E402
