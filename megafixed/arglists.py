"""Comma-separated command-line lists (``--tokens 4k,16k``, ``--seeds 0,1``, ``--tasks a,b``): one
parser for every verb, so a bad entry is always answered with the flag, the entry and an example
(never ``could not convert string to float: 'lots'``)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from .errors import UsageError

_SUFFIX = {"k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}


class ListArgError(UsageError):
    """A list-valued option with an entry that is not what the option takes."""


def _items(text, flag: str, example: str) -> list[str]:
    items = [t.strip() for t in str(text if text is not None else "").split(",") if t.strip()]
    if not items:
        raise ListArgError(f"{flag} is empty; give a comma-separated list, e.g. {flag} {example}")
    return items


def parse_list(text, flag: str, cast: Callable = str, kind: Optional[str] = None, example: str = "a,b",
               choices: Optional[Sequence[str]] = None) -> list:
    """``"a, b"`` -> ``[cast("a"), cast("b")]``; ``flag`` names the option in every error."""
    kind = kind or {int: "integer", float: "number", str: "name"}.get(cast, getattr(cast, "__name__", "value"))
    out = []
    for item in _items(text, flag, example):
        try:
            value = cast(item)
        except (ValueError, TypeError):
            article = "an" if kind[0] in "aeiou" else "a"
            raise ListArgError(f"{flag} {text}: {item!r} is not {article} {kind}; give a comma-separated list, "
                               f"e.g. {flag} {example}") from None
        if choices is not None and value not in choices:
            raise ListArgError(f"{flag} {text}: {item!r} is not one of {', '.join(map(str, choices))}")
        out.append(value)
    return out


def parse_size(item: str) -> int:
    """``"4k"`` -> 4096, ``"1m"`` -> 1048576, ``"1.5k"`` -> 1536 (binary suffixes k/m/g)."""
    s = item.strip().lower()
    mult = _SUFFIX.get(s[-1:], 1)
    if mult != 1:
        s = s[:-1]
    value = float(s) * mult
    if value != int(value):
        raise ValueError(item)
    return int(value)


def parse_sizes(text, flag: str, example: str = "4k,16k", minimum: int = 1) -> list[int]:
    """Positive integers with optional k/m/g suffixes: ``--tokens 4k,16k,1m``."""
    values = parse_list(text, flag, parse_size, kind="size (an integer, optionally with a k/m suffix)",
                        example=example)
    low = [v for v in values if v < minimum]
    if low:
        raise ListArgError(f"{flag} {text}: {low[0]} is below {minimum}; give sizes >= {minimum}, e.g. "
                           f"{flag} {example}")
    return values
