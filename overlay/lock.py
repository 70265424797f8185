"""An exclusive lock file (``fcntl.flock``) that records who holds it.

The holder writes ``pid host since`` into the file; a process that has to wait prints one line
naming them, then waits. The lock belongs to the open file, so a killed holder releases it. The
file itself stays: removing it would let two processes lock two different files of one name.

The path is opened with ``O_NOFOLLOW`` and must be a plain file: a lock that is a symbolic link is
refused (never written through to what it points at), and so is a folder or a device, each with one
line naming the path.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from overlay.errors import LockError


@contextmanager
def held(path: Path, what: str, *, wait: bool = True) -> Iterator[None]:
    """Hold the lock ``path`` for the ``with`` body; when it is taken, say so (``what`` waits) and wait; without
    ``wait``, raise :class:`LockError` at once: ``what`` (``path`` is held by ``pid N on HOST since T``)."""
    fd = _open(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise LockError(f"{what} ({path} is held by {holder(fd)})") from None
            print(f"waiting for {what}: {path} is held by {holder(fd)}", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        _record(fd)
        yield
    finally:
        os.close(fd)  # releases the lock


def _open(path: Path) -> int:
    """The lock file's descriptor: created if missing, never through a link; one line when it cannot be."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LockError(f"{path}: is a symbolic link, not a lock file (a lock is never written through a "
                            "link): remove it") from None
        if exc.errno == errno.EISDIR:
            raise LockError(f"{path}: is a folder, not a lock file: remove it") from None
        raise  # a folder that cannot be written: the caller names it (dist/, the environment)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LockError(f"{path}: is not a plain file, so not a lock file: remove it")
    return fd


def _record(fd: int) -> None:
    since = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    data = f"{os.getpid()} {socket.gethostname()} {since}\n".encode()
    os.pwrite(fd, data, 0)  # overwrite, then cut: a reader never sees an empty file
    os.ftruncate(fd, len(data))


def holder(fd: int) -> str:
    """``pid N on HOST since TIME`` from the lock file, or what is known when it is unreadable."""
    fields = os.pread(fd, 4096, 0).decode(errors="replace").split()
    if len(fields) != 3 or not fields[0].isdigit():
        return "another process (it has not recorded itself yet)"
    if any(len(f) > 64 or not f.isprintable() for f in fields):  # not what _record writes: not shown
        return "another process (its record in the lock file is not one this tool writes)"
    pid, host, since = fields
    return f"pid {pid} on {host} since {since}"


def holder_of(path: Path) -> str | None:
    """Who holds the lock ``path`` now (``pid N on HOST since T``); None when no one does, or it is not a lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while another holds it exclusively
        except BlockingIOError:
            return holder(fd)
        return None
    finally:
        os.close(fd)
