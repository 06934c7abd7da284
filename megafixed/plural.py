"""Counts in messages read as English: "1 worker", "2 workers" (not "1 workers")."""
from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``count(1, "document") == "1 document"``; ``count(3, "document") == "3 documents"``; thousands separated."""
    word = noun if n == 1 else (plural or noun + "s")
    return f"{n:,} {word}" if isinstance(n, int) else f"{n} {word}"
