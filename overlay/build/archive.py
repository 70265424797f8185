"""Reproducible tar archives: sorted members, fixed times and owners, so the same files give the same bytes."""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import Iterable

TAR_MTIME = 315532800  # 1980-01-01, the zip epoch: every member gets it


def tar_bytes(entries: Iterable[tuple[str, bytes, int]], *, gz: bool = False) -> bytes:
    """A tar of ``(name, data, mode)`` entries in name order (gzip-compressed with a fixed header when ``gz``)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mode in sorted(entries, key=lambda e: e[0]):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), TAR_MTIME, mode
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    return gzip.compress(raw, mtime=0) if gz else raw
