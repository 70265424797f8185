"""Write a folder or a file atomically: fill a temporary sibling, then swap it into place.

Every temporary folder or file the tool makes beside what it becomes (a download in the cache, a
workspace in ``.work``, an extracted tree, a release's dependency set, a report) is **owned**:
:func:`temp_dir` and :func:`temp_file` name it ``<prefix><host>-<pid>-<random><suffix>`` and hold an
exclusive ``flock`` on it while it exists. A run that is SIGKILLed (an OOM kill, a power cut, ``kill
-9``) runs no ``finally``, so before making one, and wherever a folder is read for its entries,
:func:`sweep` removes the leftovers of that prefix, saying so on stderr:

- an owned one of this machine whose process is gone *and* whose lock is free (the kernel drops a dead
  process's locks; the lock also covers a process of another PID namespace with this host name, and a
  reused pid only keeps a leftover longer);
- one of an older tool's naming (``<prefix><8 random><suffix>``, no owner recorded) in which nothing
  changed for a day.

A live process's temporary (its lock held, or its pid alive), another machine's (a shared folder: its
pid cannot be checked from here), another user's, and anything not named so, are never touched.

A child that makes temporaries of its own (pip: ``pip-unpack-*`` holding a download, ``pip-install-*``,
build environments) gets an owned folder as its ``TMPDIR`` (:func:`child_tmpdir`), so what a killed one
leaves is inside a folder this sweep removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from overlay.errors import OverlayError, one_line

_OWNED = re.compile(r"^(?P<host>[A-Za-z0-9.-]+)-(?P<pid>\d+)-[A-Za-z0-9_]+$")
_LEGACY = re.compile(r"^[a-z0-9_]{8}$")  # tempfile's own 8 characters: no owner recorded
LEGACY_QUIET_S = 24 * 3600  # an older tool's temporary in which nothing changed for a day is a leftover


def host() -> str:
    """This machine's name as a file name part (what owned temporary names record beside the pid)."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())


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


def umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def temp_dir(parent: Path, prefix: str, *, legacy: Sequence[str] = ()) -> Iterator[Path]:
    """A new owned folder ``parent/<prefix><host>-<pid>-<random>`` for the block, after :func:`sweep`.

    Whatever is still at its path when the block ends is removed (so a folder moved into place with
    ``os.replace`` stays where it went); then the lock is released. ``legacy``: the prefixes an older
    tool gave the same folders, swept too.
    """
    parent.mkdir(parents=True, exist_ok=True)
    sweep(parent, prefix, legacy=legacy)
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{host()}-{os.getpid()}-", dir=parent))
    fd = _lock(tmp, os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    try:
        yield tmp
    finally:
        try:
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            os.close(fd)


@contextmanager
def temp_file(parent: Path, prefix: str, suffix: str = ".tmp", *, legacy: Sequence[str] = ()) -> Iterator[Path]:
    """A new, empty owned file ``parent/<prefix><host>-<pid>-<random><suffix>`` (mode 0600), as
    :func:`temp_dir` for a folder: removed at the end unless it was moved away."""
    parent.mkdir(parents=True, exist_ok=True)
    sweep(parent, prefix, suffix, legacy=legacy)
    fd, name = tempfile.mkstemp(prefix=f"{prefix}{host()}-{os.getpid()}-", suffix=suffix, dir=parent)
    fd = _lock(Path(name), fd)
    try:
        yield Path(name)
    finally:
        try:
            Path(name).unlink(missing_ok=True)
        finally:
            os.close(fd)


def scratch(prefix: str) -> contextlib.AbstractContextManager[Path]:
    """:func:`temp_dir` in the system's temporary folder (``$TMPDIR``, ``/tmp``): a scratch folder that
    holds nothing the run keeps (release trees under test, a replay repository), swept the same way."""
    return temp_dir(Path(tempfile.gettempdir()), prefix)


CHILD_TMP_PREFIX = "overlay-child-tmp-"
"""The owned ``TMPDIR`` folders of children (:func:`child_tmpdir`), in the system's temporary folder."""


@contextmanager
def child_tmpdir(env: Mapping[str, str] | None = None) -> Iterator[dict[str, str]]:
    """The environment for a child that makes temporaries of its own (pip): ``env`` (default this process's)
    with ``TMPDIR`` a :func:`scratch` folder, removed with all the child left in it when the block ends, and
    by the next run's sweep when this one was killed (pip's ``pip-unpack-*`` of a killed download included)."""
    with scratch(CHILD_TMP_PREFIX) as tmp:
        yield {**(os.environ if env is None else env), "TMPDIR": str(tmp)}


def _lock(path: Path, fd: int) -> int:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new and ours: only a sweeper testing it can hold it
    except BlockingIOError:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        pass  # a filesystem without locks: the pid in the name still guards it on this machine
    return fd


def sweep(parent: Path, prefix: str, suffix: str = "", *, legacy: Sequence[str] = ()) -> list[Path]:
    """Remove the leftovers named ``parent/<prefix>...<suffix>`` (see the module docstring), one line each
    on stderr; return them. Names under ``legacy`` prefixes are judged by the older tool's naming only."""
    removed: list[Path] = []
    try:
        entries = sorted(os.scandir(parent), key=lambda e: e.name)
    except OSError:
        return removed
    for entry in entries:
        why = _leftover(entry, prefix, suffix, legacy)
        if why is None:
            continue
        path = Path(entry.path)
        size = _size(path)
        if _remove(path):
            removed.append(path)
            print(f"cleanup: removed {path} ({_words(size)}), left by {why}", file=sys.stderr, flush=True)
    return removed


def _leftover(entry: os.DirEntry[str], prefix: str, suffix: str, legacy: Sequence[str]) -> str | None:
    """Why ``entry`` is a leftover of a run that is gone, or None when it is not surely one."""
    name = entry.name
    if suffix and not name.endswith(suffix):
        return None
    stem = name[: len(name) - len(suffix)] if suffix else name
    for p in (prefix, *legacy):
        if not stem.startswith(p):
            continue
        rest = stem[len(p):]
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            return None
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)) or st.st_uid != os.geteuid():
            return None  # a link, a device, or another user's: never ours to remove
        m = _OWNED.match(rest) if p == prefix else None
        if m is not None:
            if m["host"] != host() or pid_alive(int(m["pid"])) or not _lock_free(Path(entry.path)):
                return None
            return f"a run that was killed (pid {m['pid']}, gone)"
        if _LEGACY.match(rest) and _quiet_since(Path(entry.path), time.time() - LEGACY_QUIET_S):
            return "an earlier run (an older tool's name; nothing in it changed for a day)"
    return None


def _lock_free(path: Path) -> bool:
    """Whether nobody holds ``path``'s lock (taking it for a moment tells)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return True  # a filesystem without locks: the pid decided
    finally:
        os.close(fd)
    return True


def _quiet_since(path: Path, cutoff: float) -> bool:
    """Whether nothing in ``path`` (itself, or anything below it) changed after ``cutoff``."""
    try:
        if path.lstat().st_mtime > cutoff:
            return False
        for root, dirs, files in os.walk(path):
            for n in (*dirs, *files):
                if os.lstat(os.path.join(root, n)).st_mtime > cutoff:
                    return False
    except OSError:
        return False
    return True


def _size(path: Path) -> int:
    try:
        if not path.is_dir() or path.is_symlink():
            return path.lstat().st_size
        return sum(os.lstat(os.path.join(root, n)).st_size for root, _, files in os.walk(path) for n in files)
    except OSError:
        return 0


def _remove(path: Path) -> bool:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    return not os.path.lexists(path)


def _words(size: int) -> str:
    if size >= 1_000_000:
        return f"{size / 1_000_000:.0f} MB"
    return f"{size / 1000:.0f} kB" if size >= 1000 else f"{size} bytes"


def refuse_link(dest: Path, error: type[OverlayError] = OverlayError) -> None:
    """Raise ``error`` when ``dest``, a folder :func:`replacing_dir` replaces whole, is a symbolic link: the link
    cannot be replaced by a folder (``rmtree`` refuses it), and nothing is ever written through it."""
    if dest.is_symlink():
        raise error(f"{dest}: is a symbolic link (to {one_line(os.readlink(dest))}); the folder is replaced whole, "
                    "never through a link: remove the link, or name the folder it points to")


@contextmanager
def replacing_dir(dest: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``dest`` to fill; on success it replaces ``dest``.

    On any error (an interrupt included) the temporary folder is removed and ``dest`` is left
    as it was. A ``dest`` that is a symbolic link is refused first (:func:`refuse_link`).
    """
    refuse_link(dest)
    with temp_dir(dest.parent, f".{dest.name}.tmp-") as tmp:
        yield tmp
        tmp.chmod(0o755)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)


def write_file(dest: Path, data: bytes | str) -> None:
    """Write ``data`` to ``dest`` through a temporary sibling and ``os.replace``: readers see the old
    file or the new one, never a part; on any error the sibling is removed and ``dest`` left as it was.

    The file gets the mode ``open()`` would give it (``0o666 & ~umask``), not mkstemp's 0600: reports
    and baselines are read by other users (a CI job, a container) too."""
    with temp_file(dest.parent, f".{dest.name}.", ".tmp") as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, dest)
