"""The project's own JSON records read one bounded way, and their fields checked for shape.

Every record the tool reads back (an engine check's ``results.json``, a liveness lines file, the
resolution cache, the device's ``device-requires.json``, the records under ``docs/records/engine/``) is
read through :func:`read`: a regular file only (a link to ``/dev/zero`` or a FIFO is refused, never read
until memory runs out or forever), at most :data:`LIMIT` bytes, UTF-8 (``overlay.textfile.decode``),
nested at most :data:`DEPTH` deep (a deeper document raised ``RecursionError`` in the parser), with
``NaN`` and ``Infinity`` refused (Python's parser takes them; no record of ours holds one). Whatever is
wrong is one line naming the file, raised as the caller's error class.

What the code after the parse relies on is checked by :func:`need` (a field's type, by its place in the
document), so a wrong type is that same one line, not a ``TypeError`` three calls later.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from overlay import textfile
from overlay.errors import OverlayError, shown_value

LIMIT = 64 * 1024 * 1024  # bytes: the largest record of ours is well under a MiB
DEPTH = 64  # nesting: ours are at most 8 deep

_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
          bool: "true or false", type(None): "null"}


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _depth(doc: object) -> int:
    """How deep ``doc`` nests (a scalar is 0), walked without recursion."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        value, level = stack.pop()
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if items is None:
            continue
        deepest = max(deepest, level)
        if level > DEPTH:
            break
        stack.extend((v, level + 1) for v in items)
    return deepest


def read_bytes(path: Path, error: type[OverlayError], what: str, *, limit: int | None = None) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes (:data:`LIMIT`; links followed; a FIFO
    is not waited on); else ``error`` in one line naming ``path`` and ``what`` it should be."""
    limit = LIMIT if limit is None else limit
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        why = "a symbolic link that leads back to itself (a loop)" if exc.errno == errno.ELOOP else (
            exc.strerror or str(exc))
        raise error(f"{path}: cannot read {what} ({why})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a device, FIFO or socket"
            raise error(f"{path}: is {kind}, not a file: not {what}")
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - size))):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise error(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > limit:
        raise error(f"{path}: larger than {what} may be ({limit} bytes); not read")
    return raw


def loads(raw: bytes, source: str, error: type[OverlayError], what: str, *, nonfinite: bool = False) -> Any:
    """``raw`` parsed as JSON under the module's bounds; ``error`` naming ``source`` when it is not.
    ``nonfinite``: ``NaN`` and ``-Infinity`` are values the record may hold (an engine's logprobs)."""
    text = textfile.decode(raw, source, error)
    try:
        doc = json.loads(text, **({} if nonfinite else {"parse_constant": _refuse_constant}))
    except json.JSONDecodeError as exc:
        raise error(f"{source}: not {what} (not JSON at line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except ValueError as exc:  # NaN/Infinity, an integer of more than 4300 digits
        raise error(f"{source}: not {what} ({shown_value(str(exc))})") from None
    except RecursionError:
        raise error(f"{source}: not {what} (nested deeper than {DEPTH} levels)") from None
    except MemoryError:
        raise error(f"{source}: not {what} (too large to hold in memory)") from None
    if _depth(doc) > DEPTH:
        raise error(f"{source}: not {what} (nested deeper than {DEPTH} levels)")
    return doc


def read(path: Path, error: type[OverlayError], what: str, *, limit: int | None = None, nonfinite: bool = False,
         source: str = "") -> dict[str, Any]:
    """The JSON object in ``path`` (:func:`read_bytes`, :func:`loads`); one that is not an object at its top
    level is ``error`` too. ``source`` names the file in the error lines (``--liveness P``; else ``path``)."""
    source = source or str(path)
    try:
        raw = read_bytes(path, error, what, limit=limit)
    except error as exc:
        raise error(source + str(exc).removeprefix(str(path))) from None
    doc = loads(raw, source, error, what, nonfinite=nonfinite)
    return need(doc, dict, "", source, error, what)


def kind_problem(value: object, kind: type | tuple[type, ...]) -> str | None:
    """None when ``value`` is of ``kind`` (``int`` never a ``bool``, ``float`` takes an ``int``); else
    ``expected a string, got 7`` for an error line."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds:
        kinds = (*kinds, int)
    if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds):
        return None
    want = " or ".join(dict.fromkeys(_NAMES.get(k, k.__name__) for k in kinds if not (k is int and float in kinds)))
    return f"expected {want}, got {shown_value(value)}"


def need(value: object, kind: type | tuple[type, ...], where: str, source: str, error: type[OverlayError],
         what: str = "") -> Any:
    """``value`` when it is of ``kind`` (:func:`kind_problem`); else ``error`` naming ``source`` and ``where``
    (the field's place: ``cases[2].case.dcp``)."""
    problem = kind_problem(value, kind)
    if problem is None:
        return value
    place = f"{where}: " if where else ""
    raise error(f"{source}: not {what} ({place}{problem})" if what else f"{source}: {place}{problem}")


def get(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, source: str,
        error: type[OverlayError], default: Any = None) -> Any:
    """``doc[key]`` checked by :func:`need` (``where`` is ``doc``'s place), or ``default`` when it is absent
    or null."""
    value = doc.get(key)
    if value is None:
        return default
    return need(value, kind, f"{where}.{key}" if where else key, source, error)
