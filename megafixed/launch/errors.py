"""The launch package's error type, below both ``world`` and ``head`` (which use each other's
functions: keeping the class here is what keeps their imports one-way)."""
from __future__ import annotations


class LaunchError(ValueError):
    """The launch environment is missing or inconsistent (exit 2, one line naming the variable)."""
