"""Output paths checked before a run starts: one helper for every writer.

A run that measures for minutes and then cannot write its result has lost those minutes, and a
traceback at the end says less than a line at the start. So every writer (``regress
--record-differential``/``--record-baseline``/``--out``, ``engine-checkpoint --out``,
``bench-engine --out``, ``engine-check --out``, device-stage's cache folders) asks here first:
:func:`check_file` for a file it will write, :func:`check_dir` for a folder it will fill. Nothing is
created: the nearest existing folder is probed with a temporary file, which is removed at once.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from overlay.errors import UsageError


class OutPathError(UsageError):
    """An output path that cannot be written: nothing was run (exit 2)."""


def _probe(folder: Path, what: str, path: Path) -> None:
    """Can a file be created in ``folder``? (``os.access`` says yes for root in ``/proc``.)"""
    try:
        fd, name = tempfile.mkstemp(prefix=".overlay-probe-", dir=folder)
    except OSError as exc:
        raise OutPathError(f"{what} {path}: cannot write in {folder} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(name)


def _existing_parent(path: Path, what: str) -> Path:
    """The nearest existing ancestor of ``path``; it must be a folder (not a file)."""
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutPathError(f"{what} {path}: {parent} is a file, not a folder")
            return parent
    raise OutPathError(f"{what} {path}: no existing folder above it")  # pragma: no cover (/ exists)


def check_file(path: Path | str, what: str) -> Path:
    """``path`` can be written as a file: not a folder, its folder (made if missing) writable."""
    path = Path(path)
    if path.is_dir():
        raise OutPathError(f"{what} {path}: is a folder, not a file")
    if path.exists() and not path.is_file():
        raise OutPathError(f"{what} {path}: exists and is not a regular file")
    _probe(path.parent if path.parent.is_dir() else _existing_parent(path, what), what, path)
    return path


def check_dir(path: Path | str, what: str) -> Path:
    """``path`` can be a folder to write into: a writable folder, or missing below a writable one."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise OutPathError(f"{what} {path}: is a file, not a folder")
        _probe(path, what, path)
    else:
        _probe(_existing_parent(path, what), what, path)
    return path
