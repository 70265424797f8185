"""Typed reads of a YAML mapping that collect every problem instead of raising at the first.

A profile (``regress.profiles``) is read through one :class:`Fields`: each ``get`` checks a key's type
and range (:mod:`overlay.numbers`, the command line's check) and records a problem naming the dotted
field (``gsm8k.concurrency: must be > 0, got 0``); ``unknown_keys`` names every key of a mapping that
no field read, with the nearest known one (a typo is not a default).
"""

from __future__ import annotations

import difflib
from typing import Any

from overlay import numbers
from overlay.errors import shown_value


class Fields:
    """Typed access to a YAML mapping that records problems instead of raising at the first."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        self.read: dict[int, tuple[str, dict[str, Any], set[str]]] = {}  # id -> (where, mapping, keys read)

    def section(self, data: Any, key: str, optional: bool = False) -> dict[str, Any]:
        if isinstance(data, dict):
            self.read.setdefault(id(data), ("", data, set()))[2].add(key)
        value = data.get(key) if isinstance(data, dict) else None
        if optional and value is None:
            return {}
        if not isinstance(value, dict):
            self.problems.append(f"{key}: missing or not a mapping")
            return {}
        return value

    def get(self, data: dict[str, Any], where: str, key: str, kind: type | tuple[type, ...],
            default: Any = ..., positive: bool = False, low: float | None = None,
            high: float | None = None) -> Any:
        """``data[key]`` checked to be ``kind``; a number also finite, ``> 0`` with ``positive`` (else
        ``>= low``) and ``<= high`` (:mod:`overlay.numbers`, the command line's check)."""
        self.read.setdefault(id(data), (where, data, set()))[2].add(key)
        if key not in data or data[key] is None:
            if default is ...:
                self.problems.append(f"{at(where, key)}: missing")
            return None if default is ... else default
        value = data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            self.problems.append(f"{at(where, key)}: expected {kind_name(kind)}, got {shown_value(value)}")
            return None
        if not isinstance(value, kind):
            self.problems.append(f"{at(where, key)}: expected {kind_name(kind)}, got {shown_value(value)}")
            return None
        if isinstance(value, str) and not value.strip() and default != "":  # "" is no model, no why, no path
            self.problems.append(f"{at(where, key)}: {'empty' if not value else 'only whitespace'}"
                                 + (f" (leave it out for {default!r})" if isinstance(default, str) else ""))
            return None
        if isinstance(value, int | float):
            wrong = numbers.problem(value, 0 if positive else low, strict=positive, high=high)
            if wrong:
                self.problems.append(f"{at(where, key)}: {wrong}")
                return None
        return value


    def unknown_keys(self) -> list[str]:
        """One problem per key of a validated mapping that no field read: a typo is not a default."""
        problems = []
        for where, data, read in self.read.values():
            for key in data:
                if key not in read:
                    close = difflib.get_close_matches(str(key), sorted(read), n=1)
                    hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(sorted(read))})"
                    problems.append(f"{at(where, key)}: unknown field{hint}")
        return problems


def at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({"str": "a string", "int": "an integer", "float": "a number", "list": "a list",
                        "dict": "a mapping", "bool": "true/false"}.get(k.__name__, k.__name__) for k in kinds)
