"""Error types of the data pipeline; every message names the file or value at fault and the fix."""
from __future__ import annotations

from ..errors import ConfigError


class DataError(ConfigError):
    """Bad data input, shard or tokenizer. A ConfigError (hence a ValueError): the CLI verbs that
    print config errors cleanly (train, quickstart) report data errors the same way."""


class ShardError(DataError):
    """A .bin/.idx pair that is missing, truncated or corrupt."""


class VocabError(DataError):
    """A tokenizer vocabulary that does not fit the model or its fixed codes."""


def check_vocab_fits(vocab: int, *, model_vocab: int | None = None, code_bits: int | None = None,
                     where: str = "tokenizer") -> None:
    """Refuse a vocabulary the run cannot represent (the model head, or the fixed ±1 codes)."""
    if model_vocab is not None and vocab > model_vocab:
        raise VocabError(f"{where} has {vocab} tokens but model.vocab_size={model_vocab}; set "
                         f"model.vocab_size>={vocab} or train a tokenizer with at most {model_vocab} tokens")
    if code_bits is not None and vocab > (1 << code_bits):
        raise VocabError(f"{where} has {vocab} tokens but {code_bits}-bit fixed codes hold only "
                         f"{1 << code_bits} ids; raise model.code_bits (--code-bits) to at least "
                         f"{max(1, (vocab - 1).bit_length())} or use a tokenizer with at most "
                         f"{1 << code_bits} tokens")
