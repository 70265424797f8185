"""Write a folder atomically: fill a temporary sibling, then swap it into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
