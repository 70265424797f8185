"""Write a folder or a file atomically: fill a temporary sibling, then swap it into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from overlay.build.distdir import umask


@contextmanager
def replacing_dir(dest: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``dest`` to fill; on success it replaces ``dest``.

    On any error (an interrupt included) the temporary folder is removed and ``dest`` is left
    as it was.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_file(dest: Path, data: bytes | str) -> None:
    """Write ``data`` to ``dest`` through a temporary sibling and ``os.replace``: readers see the old
    file or the new one, never a part; on any error the sibling is removed and ``dest`` left as it was.

    The file gets the mode ``open()`` would give it (``0o666 & ~umask``), not mkstemp's 0600: reports
    and baselines are read by other users (a CI job, a container) too."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
