"""A release's Python tree as the facts read it: a folder holding ``vllm/`` (an unpacked text tree, the
folder an installed or staged ``vllm`` lives in) or a wheel, read in place."""

from __future__ import annotations

import importlib.util
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class Tree(Protocol):
    """Files of one release's tree by their path below its root (``vllm/envs.py``)."""

    @property
    def where(self) -> str: ...

    def read(self, path: str) -> str | None: ...


@dataclass(frozen=True)
class FolderTree:
    """A folder holding ``vllm/``."""

    root: Path

    @property
    def where(self) -> str:
        return str(self.root)

    def read(self, path: str) -> str | None:
        try:
            return (self.root / path).read_text(encoding="utf-8", errors="replace")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None


@dataclass(frozen=True)
class WheelTree:
    """A wheel's members, read without unpacking it."""

    wheel: Path

    @property
    def where(self) -> str:
        return str(self.wheel)

    def read(self, path: str) -> str | None:
        with zipfile.ZipFile(self.wheel) as zf:
            try:
                return zf.read(path).decode("utf-8", errors="replace")
            except KeyError:
                return None


def open_tree(path: Path) -> Tree:
    """``path`` as a tree: a wheel file, else a folder."""
    return WheelTree(path) if path.suffix == ".whl" and path.is_file() else FolderTree(path)


def importable_tree() -> Path | None:
    """The folder the importable ``vllm`` lives in (found, not imported); None when there is none."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent
