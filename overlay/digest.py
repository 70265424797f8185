"""The one content digest of the tool: hex sha256 of bytes, text or a file.

Pins, patches, wheels, caches, staged files and recorded references all name content by it; the
files we write call the field ``sha256`` (pin.toml, ``_overlay.json``, manifests), which is this.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

ALGORITHM = "sha256"


def of_bytes(data: bytes) -> str:
    return hashlib.new(ALGORITHM, data).hexdigest()


def of_text(text: str) -> str:
    """Of the text's UTF-8 bytes."""
    return of_bytes(text.encode())


def of_file(path: Path) -> str:
    """Of a file's bytes, streamed."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, ALGORITHM).hexdigest()
