"""Put one built file into ``dist/``: one build at a time, through a temporary file, errors as one line.

Builds into one folder take turns (a lock file, :mod:`overlay.lock`). The file is written under
a temporary name that records its writer (``.building-<host>-<pid>-<random>.whl.tmp``) and
renamed at the end, so a failed or killed build leaves the previous file alone; a later build
removes a temporary file only once its writer is gone. The result gets the mode ``cp`` would
give it (``0o666 & ~umask``). Full disks, read-only folders and a file in the way of ``dist/``
are :class:`~overlay.errors.DistError` naming the path and what to do.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from overlay import lock
from overlay.errors import DistError

LOCK_NAME = ".overlay-build.lock"
TMP_PREFIX = ".building-"
TMP_SUFFIX = ".whl.tmp"
_TMP_NAME = re.compile(r"^\.building-(?P<host>.+)-(?P<pid>\d+)-[^-]+\.whl\.tmp$")
_LEGACY_MAX_AGE_S = 3600  # a temporary file without a writer (older tool): left alone for an hour
_ANOTHER = "build into another folder (--dist)"


def write_into(dist: Path, name: str, write: Callable[[Path], None]) -> Path:
    """Create ``dist/name`` with ``write(temporary path)``; return it. Nothing else in ``dist`` changes."""
    _make_dir(dist)
    target = dist / name
    with _as_dist_error(dist, target), lock.held(dist / LOCK_NAME, f"another build into {dist}"):
        remove_stale(dist)
        fd, tmp_name = tempfile.mkstemp(dir=dist, prefix=f"{TMP_PREFIX}{host()}-{os.getpid()}-",
                                        suffix=TMP_SUFFIX)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            write(tmp)
            tmp.chmod(0o666 & ~umask())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


def umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remove_stale(dist: Path) -> list[Path]:
    """Remove the temporary files in ``dist`` whose writing process is gone; return them."""
    removed = []
    for path in sorted(dist.glob(f"{TMP_PREFIX}*{TMP_SUFFIX}")):
        if _writer_gone(path):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _writer_gone(path: Path) -> bool:
    m = _TMP_NAME.match(path.name)
    if m is None:  # no writer recorded in the name (an older tool): only an old one is surely dead
        try:
            return time.time() - path.stat().st_mtime > _LEGACY_MAX_AGE_S
        except FileNotFoundError:
            return False
    if m["host"] != host():
        return False  # another machine's process (a shared folder): it cannot be checked from here
    return not pid_alive(int(m["pid"]))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (signal 0 checks without sending)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def host() -> str:
    """This machine's name as a file name part (what owned temporary names record beside the pid)."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())


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
    where = exc.filename or target
    return f"{where}: cannot write the wheel: {exc.strerror or exc}: check {dist} or {_ANOTHER}"
