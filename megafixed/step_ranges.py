"""Ranges of steps, as ``data.skip_steps`` spells them (``"5-6,900-1200"``, steps as numbered in the
logs, ranges inclusive): the parser the config's check and the guard's ``train/callbacks/guard/skip.py``
share. Imports nothing of megafixed, so the config module can use it without reaching into ``train/``."""
from __future__ import annotations

from typing import Iterable


class SkipStepsError(ValueError):
    """A malformed ``data.skip_steps`` (exit 2, one line)."""


def parse(text, key: str = "data.skip_steps", error: type = None) -> list[tuple[int, int]]:
    """``"5-6,900-1200"`` (or a list of such items, or ints) -> sorted, merged inclusive ranges.
    ``error``: the exception class to raise (the config's ConfigError), else SkipStepsError."""
    if text is None or text == "":
        return []
    error = error or SkipStepsError
    items = [p for item in (text if isinstance(text, (list, tuple)) else [text]) for p in str(item).split(",")]
    ranges = []
    for item in items:
        part = str(item).strip()
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise error(f"{key}={text!r}: {part!r} is not a step or a range of steps; write e.g. "
                                 f"'5-6,900-1200' (steps as numbered in the logs, ranges inclusive)") from None
        if a < 1 or b < a:
            raise error(f"{key}={text!r}: {part!r} is not a range of steps >= 1 (first <= last)")
        ranges.append((a, b))
    return merge(ranges)


def merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def spelled(ranges: Iterable[tuple[int, int]]) -> str:
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges)
