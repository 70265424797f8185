"""What every verb shares: the release option, the patches folder, and checked number types.

Numbers a person types are checked by the parser (argparse prints ``usage`` and one line, exit 2),
so a run never starts with a value it cannot use.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from overlay import numbers, outpaths


def root(ns: argparse.Namespace) -> Path:
    """The folder holding ``patches/<version>/`` (``overlay --patches``)."""
    return Path(ns.patches)


def refuse_empty_values(parser: argparse.ArgumentParser) -> None:
    """Every option and positional of ``parser`` and its verbs that takes a value refuses an empty or blank
    one, unless ``""`` is its own default (there it means "none", as the default does).

    An empty value is an unset variable (``--dist "$DIST"``), never a choice: a path made of it is the
    current folder (``--dist ''`` wrote the wheel into the repository root), a name or release made of it is
    looked up as the folder above. The parser refuses it with usage and one line, exit 2.
    """
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                refuse_empty_values(sub)
        elif action.nargs != 0 and action.default != "":
            action.type = _not_empty(action.type, "; leave the option out for its default" if action.option_strings
                                     else "")


def _not_empty(kind: Callable[[str], object] | str | None, fix: str) -> Callable[[str], object]:
    assert not isinstance(kind, str), "a type given by name"

    def parse(text: str) -> object:
        if not text.strip():
            raise argparse.ArgumentTypeError(
                f"expected a value, got {text!r}: {'empty' if not text else 'only whitespace'} (an unset "
                f"variable?){fix}")
        return text if kind is None else kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names the type in its messages
    return parse


def folder_name(inside: str) -> Callable[[str], str]:
    """One folder name, made into a path inside ``inside`` (an option: ``--dest``): ``../../x``, ``a/b``, ``/x``,
    ``.`` and ``..`` are refused (:func:`overlay.outpaths.check_name`), so the path stays in that folder."""
    def parse(text: str) -> str:
        try:
            return outpaths.check_name(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected one folder name, got {text!r}: {exc} (the folder is made "
                                             f"inside {inside})") from None

    parse.__name__ = "folder name"
    return parse


def add_vllm(sp: argparse.ArgumentParser) -> None:
    """``--vllm``: the pinned release; ``None`` here is resolved from ``patches/DEFAULT`` by ``overlay.cli``."""
    sp.add_argument("--vllm", help="pinned vLLM release (default: patches/DEFAULT)")


def _bounded(kind: Callable[[str], int | float], name: str, low: float, *, strict: bool = False,
             high: float | None = None) -> Callable[[str], int | float]:
    """A ``type=`` that parses with ``kind`` and checks the range with :mod:`overlay.numbers` (the profiles'
    check too): ``nan``, ``inf`` and ``1e999`` are refused like any out-of-range number."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
        if not numbers.in_range(value, low, strict=strict, high=high):
            why = "" if numbers.finite(value) else ": not a finite number"
            raise argparse.ArgumentTypeError(
                f"expected {name} {numbers.bounds(low, strict=strict, high=high)}, got {text}{why}")
        return value

    parse.__name__ = name  # argparse names the type in its messages
    return parse


def at_least(low: int, high: int | None = None) -> Callable[[str], int | float]:
    """An integer ``>= low`` (and ``<= high``)."""
    return _bounded(int, "an integer", low, high=high)


def port() -> Callable[[str], int | float]:
    """A TCP port, 1 to 65535."""
    return at_least(1, 65535)


def fraction(name: str = "a fraction") -> Callable[[str], int | float]:
    """A number ``> 0`` and ``<= 1`` (a share of the GPU's memory)."""
    return _bounded(float, name, 0.0, strict=True, high=1.0)


def int_list(low: int, high: int | None = None) -> Callable[[str], list[int]]:
    """Comma-separated integers, at least one, each ``>= low`` (and ``<= high``): ``1,8,64``."""
    one = at_least(low, high)

    def parse(text: str) -> list[int]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        return [int(one(x)) for x in items]

    parse.__name__ = "comma-separated integers"
    return parse


def positive(name: str = "a number") -> Callable[[str], int | float]:
    """A number ``> 0``."""
    return _bounded(float, name, 0.0, strict=True)


def between(low: float, high: float, name: str = "a number") -> Callable[[str], int | float]:
    """A number ``>= low`` and ``<= high`` (a size with a floor: ``--limit-mib``)."""
    return _bounded(float, name, low, high=high)


def non_negative(name: str = "seconds") -> Callable[[str], int | float]:
    """A number ``>= 0`` (where the option says so, 0 means "none")."""
    return _bounded(float, name, 0.0)
