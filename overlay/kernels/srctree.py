"""Bring the kernel build's fixed source tree up to date with a fresh extraction, in place.

``scripts/build-kernels.sh`` unpacks the pinned sdist with the series applied into a new folder on
every run (an edit of a kernel patch is always seen), but builds from a fixed one (``WORK/src``):
ccache keys on the ``-I`` paths, and configure writes generated sources into that tree (vLLM
0.28.0's marlin and machete generators write ``csrc/.../kernel_selector.h`` and
``machete/generated/*.cu`` at configure time, and skip it on the next configure when their script's
hash is unchanged). Replacing the whole tree would delete those generated files while the build
folder still believes them current, and the next build fails on a missing header.

:func:`sync_tree` therefore updates the fixed tree file by file: a file whose bytes are unchanged is
not touched (its mtime stays, so ninja does not rebuild what includes it), a changed or new file is
written (a new mtime: ninja rebuilds its dependants), and a file that the previous extraction put
there and the new one lacks is removed. The extraction's file list is kept in
``<tree>/.overlay-extracted``; a file not in that list is the build's own (generated) and stays.
"""

from __future__ import annotations

import filecmp
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from overlay.atomic import write_file
from overlay.errors import OverlayError

MANIFEST = ".overlay-extracted"


@dataclass(frozen=True)
class SyncResult:
    """What :func:`sync_tree` changed in the fixed tree."""

    written: tuple[str, ...]
    removed: tuple[str, ...]
    kept: int

    def summary(self) -> str:
        shown = ", ".join(self.written[:3]) + (", ..." if len(self.written) > 3 else "")
        return (f"{len(self.written)} file(s) changed or new{f' ({shown})' if self.written else ''}, "
                f"{len(self.removed)} removed, {self.kept} unchanged")


def _files(root: Path) -> list[str]:
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if rel == MANIFEST:
                continue
            if path.is_symlink() or not path.is_file():
                raise OverlayError(f"{path}: not a regular file in the extracted source tree")
            out.append(rel)
    return out


def _previous(dest: Path) -> list[str]:
    try:
        return [line for line in (dest / MANIFEST).read_text().splitlines() if line]
    except FileNotFoundError:
        return []


def sync_tree(fresh: Path, dest: Path) -> SyncResult:
    """Make ``dest`` hold ``fresh``'s files (see the module docstring); ``fresh`` is left as it was."""
    if not fresh.is_dir():
        raise OverlayError(f"{fresh}: no extracted source tree")
    if dest.exists() and not (dest / MANIFEST).is_file() and any(dest.iterdir()):
        # a tree from before the manifest, or someone's folder: no way to tell its own files from ours
        raise OverlayError(f"{dest}: a source tree without {MANIFEST}; remove it (rm -rf {dest}) and build again")
    new = _files(fresh)
    new_set = set(new)
    written: list[str] = []
    kept = 0
    for rel in new:
        src, dst = fresh / rel, dest / rel
        if dst.is_file() and not dst.is_symlink() and filecmp.cmp(src, dst, shallow=False):
            if (src.stat().st_mode & 0o111) != (dst.stat().st_mode & 0o111):
                shutil.copymode(src, dst)
            kept += 1
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        tmp = dst.with_name(f".{dst.name}.sync-tmp")
        shutil.copy2(src, tmp)
        os.utime(tmp)  # now: newer than every object built from the old bytes
        os.replace(tmp, dst)
        written.append(rel)
    removed: list[str] = []
    for rel in _previous(dest):
        if rel not in new_set and (dest / rel).is_file():
            (dest / rel).unlink()
            removed.append(rel)
    write_file(dest / MANIFEST, "".join(f"{rel}\n" for rel in new))
    return SyncResult(tuple(written), tuple(removed), kept)
