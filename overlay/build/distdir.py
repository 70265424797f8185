"""Put one built file into ``dist/``: one build at a time, through a temporary file, errors as one line.

Builds into one folder take turns (a lock file, :mod:`overlay.lock`). The file is written under
a temporary name that records its writer (``.building-<host>-<pid>-<random>.whl.tmp``) and
renamed at the end, so a failed or killed build leaves the previous file alone; a later build
removes a temporary file only once its writer is gone (:func:`overlay.atomic.temp_file`, the one
sweep). The result gets the mode ``cp`` would
give it (``0o666 & ~umask``). Full disks, read-only folders, a file in the way of ``dist/`` and a folder
where the wheel goes are :class:`~overlay.errors.DistError` naming the path at fault and what to do.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from overlay import lock
from overlay.atomic import temp_file, umask
from overlay.errors import DistError

LOCK_NAME = ".overlay-build.lock"
TMP_PREFIX = ".building-"
TMP_SUFFIX = ".whl.tmp"
_ANOTHER = "build into another folder (--dist)"


def write_into(dist: Path, name: str, write: Callable[[Path], None]) -> Path:
    """Create ``dist/name`` with ``write(temporary path)``; return it. Nothing else in ``dist`` changes."""
    _make_dir(dist)
    target = dist / name
    with _as_dist_error(dist, target), lock.held(dist / LOCK_NAME, f"another build into {dist}"), \
            temp_file(dist, TMP_PREFIX, TMP_SUFFIX) as tmp:  # owned: a killed build's is swept by the next
        write(tmp)
        tmp.chmod(0o666 & ~umask())
        os.replace(tmp, target)
    return target


def _make_dir(dist: Path) -> None:
    if dist.exists() and not dist.is_dir():
        raise DistError(f"{dist}: is a file, not a folder: move it away or {_ANOTHER}")
    try:
        dist.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        in_way = next((p for p in dist.parents if p.exists() and not p.is_dir()), None)
        if in_way is not None:
            raise DistError(f"{dist}: cannot create the folder: {in_way} is a file: move it away or "
                            f"{_ANOTHER}") from exc
        raise DistError(f"{dist}: cannot create the folder ({exc.strerror}): make its parent writable or "
                        f"{_ANOTHER}") from exc


@contextmanager
def _as_dist_error(dist: Path, target: Path) -> Iterator[None]:
    """Turn an OSError while writing into ``dist`` into one line naming the path and the fix."""
    try:
        yield
    except OSError as exc:
        raise DistError(_explain(exc, dist, target)) from exc


def _explain(exc: OSError, dist: Path, target: Path) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"{target}: cannot write the wheel: {exc.strerror}: free space on the filesystem of {dist} "
                f"(or {_ANOTHER}) and build again")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{dist}: cannot write into it ({exc.strerror}): make it writable (chmod u+w {dist}) or {_ANOTHER}"
    if exc.filename2 is not None and exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
        # a rename's error: the destination is in the way (``filename`` is the temporary, removed by now)
        if Path(exc.filename2).is_dir():
            return f"{exc.filename2}: is a folder where the wheel goes: move it away or {_ANOTHER}"
        return f"{exc.filename2}: cannot put the wheel there: {exc.strerror or exc}: check {dist} or {_ANOTHER}"
    where = exc.filename or target
    return f"{where}: cannot write the wheel: {exc.strerror or exc}: check {dist} or {_ANOTHER}"
