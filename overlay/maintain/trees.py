"""Unpacked source trees of a release's Python package, cached outside the repo.

The patch tests run against two trees: the installed patched wheel, and the unpatched
base tree made here (the pinned wheel's text files, extracted once into
``<cache>/trees/<version>-<sha256[:12]>/``), or that base with the patches before one
(:func:`prefix_tree`: what a patch is judged without). Putting that folder first on ``sys.path``
(``OVERLAY_VLLM_TREE``) makes ``import vllm`` resolve to the base.

:func:`release_tree` does the same for any release: from its ``pin.toml`` where the repository
keeps one (``patches/<v>/``, ``tests/pins/<v>/``), else from the wheel and digest the package
index publishes (the path ``make rebase`` takes for a release without a pin).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from overlay import digest
from overlay.atomic import temp_dir
from overlay.build.apply import apply_series
from overlay.build.fetch import cache_dir, fetch_release, fetch_wheel
from overlay.build.pins import Pin, load_pin, pin_dir
from overlay.build.series import Patch
from overlay.maintain.workspace import extract_text_tree


def base_tree(patches_root: Path, version: str, *, cache: Path | None = None) -> Path:
    """The unpatched Python tree of ``version`` (extracted on first use, atomically)."""
    return pinned_tree(load_pin(patches_root, version), cache=cache)


def pinned_tree(pin: Pin, *, cache: Path | None = None, wheel: Path | None = None) -> Path:
    """The text tree of ``pin``'s wheel (``wheel``: already fetched and verified), extracted once."""
    root = (cache or cache_dir()) / "trees"
    dest = root / f"{pin.version}-{pin.sha256[:12]}"
    if dest.is_dir():
        return dest
    wheel = wheel or fetch_wheel(pin, cache=cache)
    with temp_dir(root, ".extract-", legacy=(f".{dest.name}-",)) as tmp:  # a killed run's: removed by the next
        extract_text_tree(wheel, tmp)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not dest.is_dir():  # another process won the race: fine
                raise
    return dest


def prefix_tree(patches_root: Path, version: str, patches: tuple[Patch, ...], *, cache: Path | None = None) -> Path:
    """The base tree of ``version`` with ``patches`` applied in order: what a patch's tests run on
    without it (the release plus the patches before it). Made once per content of those patches,
    atomically, under ``<cache>/trees/``; the base tree itself when ``patches`` is empty."""
    base = base_tree(patches_root, version, cache=cache)
    if not patches:
        return base
    key = digest.of_text("\n".join(digest.of_bytes(p.raw) for p in patches))[:16]
    dest = base.parent / f"{base.name}-prefix-{len(patches)}-{key}"
    if dest.is_dir():
        return dest

    def read_base(path: str) -> bytes | None:
        file = base / path
        return file.read_bytes() if file.is_file() else None

    applied = apply_series(patches, read_base, f"the {version} tree")
    with temp_dir(base.parent, ".prefix-") as tmp:  # a killed run's: removed by the next
        copy_tree(base, tmp)
        for path, data in applied.changed.items():
            (tmp / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp / path).write_bytes(data)
        for path in applied.deleted:
            (tmp / path).unlink()
        try:
            os.replace(tmp, dest)
        except OSError:
            if not dest.is_dir():  # another process won the race: fine
                raise
    return dest


def copy_tree(tree: Path, dest: Path) -> None:
    """Copy the text tree ``tree`` into ``dest`` (a cached tree is never written to)."""
    shutil.copytree(tree, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))


def release_pin(version: str, pins_roots: list[Path]) -> Pin | None:
    """The first ``<root>/<version>/pin.toml`` among ``pins_roots``; ``None`` when none has one."""
    for root in pins_roots:
        if (pin_dir(root, version) / "pin.toml").is_file():
            return load_pin(root, version)
    return None


def release_tree(version: str, pins_roots: list[Path], *, cache: Path | None = None) -> tuple[Pin, Path]:
    """(pin, text tree) of release ``version``: pinned in one of ``pins_roots``, else from the index."""
    pin = release_pin(version, pins_roots)
    if pin is not None:
        return pin, pinned_tree(pin, cache=cache)
    pin, wheel = fetch_release(version, cache=cache)
    return pin, pinned_tree(pin, cache=cache, wheel=wheel)
