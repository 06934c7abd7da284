"""megafixed: GPT pretraining with fixed token codes in place of a trainable input table."""
__version__ = "0.1.0"

# Lazy (PEP 562): ``megafixed.codes`` imports torch (seconds), which verbs that never touch a model
# -- preprocess, tokenizer, data -- should not pay at start-up, and the CLI sets OpenMP's wait policy
# before torch loads OpenMP (megafixed/threads.py).
_LAZY = {"CodeError": "codes", "FixedCode": "codes", "bits_needed": "codes"}


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
