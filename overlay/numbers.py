"""One range check for every number a person gives: the command line's options
(:mod:`overlay.commands.common`), a regress profile's fields (:mod:`overlay.regress.profiles`) and the
settings read from the environment (``REGRESS_ATTACH_TIMEOUT``).

NaN and infinity are in no range. A plain comparison lets NaN through every bound (``nan < 0`` and
``nan > 1`` are both false), so ``--ready-timeout nan`` waited forever and a profile threshold of ``.nan``
could never fire; infinity passes every lower bound.
"""

from __future__ import annotations

import math


def finite(value: float) -> bool:
    """Whether ``value`` is a number a check can use (an ``int`` always is)."""
    return not isinstance(value, float) or math.isfinite(value)


def bounds(low: float | None = None, *, strict: bool = False, high: float | None = None) -> str:
    """The range in words, as the messages say it: ``> 0``, ``>= 1 and <= 65535``; ``finite`` unbounded."""
    parts = ([f"{'>' if strict else '>='} {low}"] if low is not None else []) + (
        [f"<= {high}"] if high is not None else [])
    return " and ".join(parts) or "finite"


def in_range(value: float, low: float | None = None, *, strict: bool = False, high: float | None = None) -> bool:
    """Whether ``value`` is finite, ``>= low`` (``> low`` when ``strict``) and ``<= high``."""
    if not finite(value):
        return False
    if low is not None and (value < low or (strict and value == low)):
        return False
    return high is None or value <= high


def problem(value: float, low: float | None = None, *, strict: bool = False, high: float | None = None) -> str | None:
    """None when :func:`in_range`, else the words for an error line: ``must be > 0, got -1``,
    ``must be a finite number > 0, got nan``."""
    if in_range(value, low, strict=strict, high=high):
        return None
    want = bounds(low, strict=strict, high=high)
    if not finite(value):
        want = "a finite number" + ("" if want == "finite" else f" {want}")
    return f"must be {want}, got {value!r}"
