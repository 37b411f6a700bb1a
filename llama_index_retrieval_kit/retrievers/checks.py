"""Argument checks shared by the retrievers, so every one rejects bad input with the same message."""

from __future__ import annotations

from typing import Any


def check_positive_int(name: str, value: Any) -> int:
    """``value`` if it is an int >= 1 (bools are not ints here); else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value
