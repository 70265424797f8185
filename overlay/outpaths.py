"""Output paths checked before a run starts: one helper for every writer.

A run that measures for minutes and then cannot write its result has lost those minutes, and a
traceback at the end says less than a line at the start. So every writer (``regress
--record-differential``/``--record-baseline``/``--out``, ``engine-checkpoint --out``,
``bench-engine --out``, ``engine-check --out``, device-stage's cache folders) asks here first:
:func:`check_file` for a file it will write, :func:`check_dir` for a folder it will fill. Nothing is
created: the nearest existing folder is probed with a temporary file, which is removed at once.

Where a folder the tool fills with folders of its own comes from a setting (the cache root,
``VLLM_OVERLAY_CACHE``), :func:`check_own_folder` keeps it out of the repository and off a folder that
holds other things (``/``, the home folder, a folder above the repository); :func:`check_name` keeps a
name given for a folder (``device-stage --name``) one folder inside its parent.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from overlay.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
"""The repository holding the ``overlay`` package: no cache is it, inside it or above it."""


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


def check_own_folder(path: Path | str, what: str, *, holds: str, default: str) -> Path:
    """``path`` when it can be a folder of the tool's own (the cache root): not the repository, not inside it,
    not a folder above it (``/``), not the home folder itself. Else one :class:`OutPathError` line naming
    ``what`` (``VLLM_OVERLAY_CACHE``), what the tool writes into it (``holds``) and the ``default``.

    Links are followed (a link into the repository is the repository); nothing is created.
    """
    try:
        real = Path(path).resolve()  # '~' is a folder named so, as every writer reads it
    except (OSError, RuntimeError):  # Python 3.11 and 3.12 raise RuntimeError for a loop, later ones OSError
        raise OutPathError(f"{what} {str(path)!r}: a symbolic link that leads back to itself (a loop): name a folder "
                           f"of its own (unset: {default})") from None
    repo = REPO.resolve()
    if real == repo:
        why = "is the repository"
    elif repo in real.parents:
        why = f"is inside the repository {repo}"
    elif real == Path(real.anchor):
        why = "is the filesystem root"
    elif real in repo.parents:
        why = f"holds the repository {repo}"
    elif real == Path.home().resolve():
        why = "is the home folder"
    else:
        return Path(path)
    raise OutPathError(f"{what} {str(path)!r}: {real} {why}, and the tool writes {holds} straight into it: name a "
                       f"folder of its own (unset: {default})")


def check_name(name: str) -> str:
    """``name`` when it is one folder name, so a path made of it stays inside its parent: not ``.`` or ``..``,
    no ``/``, no NUL. Else a ``ValueError`` saying why, for the caller's one line."""
    if "/" in name or "\0" in name:
        raise ValueError(f"it holds {'a /' if '/' in name else 'a NUL'}")
    if name in (".", ".."):
        raise ValueError(f"{name!r} is the folder itself or the one above it")
    return name
