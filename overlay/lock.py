"""An exclusive lock file (``fcntl.flock``) that records who holds it.

The holder writes ``pid host since`` into the file; a process that has to wait prints one line
naming them, then waits. The lock belongs to the open file, so a killed holder releases it. The
file itself stays: removing it would let two processes lock two different files of one name.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path


@contextmanager
def held(path: Path, what: str) -> Iterator[None]:
    """Hold the lock ``path`` for the ``with`` body; when it is taken, say so (``what`` waits) and wait."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {what}: {path} is held by {holder(fd)}", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        _record(fd)
        yield
    finally:
        os.close(fd)  # releases the lock


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
    pid, host, since = fields
    return f"pid {pid} on {host} since {since}"
