"""Unpacked source trees of a release's Python package, cached outside the repo.

The patch tests run against two trees: the installed patched wheel, and the unpatched
base tree made here (the pinned wheel's text files, extracted once into
``<cache>/trees/<version>/``). Putting that folder first on ``sys.path``
(``OVERLAY_VLLM_TREE``) makes ``import vllm`` resolve to the base.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from overlay.fetch import cache_dir, fetch_wheel
from overlay.pins import load_pin
from overlay.workspace import extract_text_tree


def base_tree(patches_root: Path, version: str, *, cache: Path | None = None) -> Path:
    """The unpatched Python tree of ``version`` (extracted on first use, atomically)."""
    pin = load_pin(patches_root, version)
    root = (cache or cache_dir()) / "trees"
    dest = root / f"{pin.version}-{pin.sha256[:12]}"
    if dest.is_dir():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    wheel = fetch_wheel(pin, cache=cache)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=root))
    try:
        extract_text_tree(wheel, tmp)
        os.replace(tmp, dest)
    except OSError:
        if not dest.is_dir():  # another process won the race: fine
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest
