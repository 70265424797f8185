"""Tiny synthetic releases for the rebase and cherry-pick tests: two versions' files, patches made with git.

``BASE`` is release ``FROM``'s tree, ``TARGET`` release ``TO``'s (offsets, a change upstream made
the patch's way, one made differently, a rename, a fold, a fix of upstream's own);
``make_patch`` writes a format-patch file of a change; ``series_dir`` a ``patches/<version>/``.
"""

from __future__ import annotations

from pathlib import Path

from overlay.build.pins import Pin
from overlay.git import git, init_repo
from overlay.maintain.workspace import format_patch

FROM, TO = "0.1.0", "0.2.0"
TARGET_PIN = Pin(TO, f"vllm-{TO}-cp38-abi3-manylinux_2_28_x86_64.whl", "ab" * 32)


def lines(prefix: str, n: int, **edits: str) -> str:
    """``n`` distinct lines ``<prefix>_<i> = <i>``, some replaced by ``edits`` (key ``l<i>``)."""
    return "".join(edits.get(f"l{i}", f"{prefix}_{i} = {i}") + "\n" for i in range(1, n + 1))


BASE: dict[str, str] = {
    "vllm/__init__.py": "",
    "vllm/a.py": lines("a", 40),
    "vllm/c.py": lines("c", 40),
    "vllm/v1/attention/ops/dcp_utils.py": lines("dcp", 40),
    "vllm/v1/attention/ops/dcp_alltoall.py": lines("a2a", 30),
    "vllm/fix.py": "def guard(meta):\n    return meta['decode']\n",
}

# The next release: new lines at the top of a.py (offsets), c.py's line 5 already changed the way a
# patch changes it, c.py's line 10 changed differently, dcp_utils.py renamed to ops/dcp.py (with new
# code), dcp_alltoall.py folded into dcp.py, guard() fixed with upstream's own code.
TARGET: dict[str, str] = {
    "vllm/__init__.py": "",
    "vllm/a.py": "# new header\nimport os\n\n" + lines("a", 40),
    "vllm/c.py": lines("c", 40, l5="c_5 = 'five'", l10="c_10 = 'upstream ten'", l28="c_28 = 'up'"),
    "vllm/v1/attention/ops/dcp.py": lines("dcp", 40) + lines("newdcp", 12) + lines("a2a", 30),
    "vllm/fix.py": "def guard(meta):\n    return getattr(meta, 'decode', None) if not isinstance(meta, dict) "
                   "else meta.get('decode')\n",
}


def fill(files: dict[str, str]):
    def write(dest: Path) -> None:
        for path, text in files.items():
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            (dest / path).write_text(text)
    return write


def make_patch(tmp: Path, name: str, changes: dict[str, str], base: dict[str, str] = BASE) -> bytes:
    """A format-patch file changing ``base`` to ``base | changes``, with trailers."""
    repo = tmp / f"author-{name}"
    init_repo(repo)
    fill(base)(repo)
    git(["add", "-A"], repo)
    git(["commit", "-q", "-m", "base"], repo)
    fill(changes)(repo)
    git(["add", "-A"], repo)
    msg = f"Fix {name}\n\nWhy it is needed.\n\nOrigin: vendor\nLast-Update: 2026-11-30\n"
    git(["commit", "-q", "-m", msg], repo)
    return format_patch(repo, "HEAD")


def series_dir(root: Path, patches: dict[str, bytes], version: str = FROM) -> Path:
    d = root / version
    d.mkdir(parents=True)
    (d / "pin.toml").write_text(Pin(version, f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl",
                                    "cd" * 32).to_toml())
    (d / "series").write_text("# test series\n" + "".join(f"{n}\n" for n in patches))
    for n, raw in patches.items():
        (d / n).write_bytes(raw)
    return d


REPO_PATCHES = Path(__file__).resolve().parent.parent / "patches"
TEST_PINS = Path(__file__).resolve().parent / "pins"  # real releases we keep no series for (0.29.0)


def _pins_root(version: str) -> Path:
    return REPO_PATCHES if (REPO_PATCHES / version).is_dir() else TEST_PINS


def cached_tree(version: str) -> Path | None:
    """The pinned release's text tree, extracted once into the cache (:func:`overlay.maintain.trees.base_tree`);
    ``None`` when its wheel was never fetched (nothing is downloaded here)."""
    from overlay.build.fetch import cache_dir
    from overlay.build.pins import load_pin
    from overlay.maintain.trees import base_tree

    root = _pins_root(version)
    if not (cache_dir() / "wheels" / load_pin(root, version).wheel).is_file():
        return None
    return base_tree(root, version)


def copy_of(tree: Path):
    """A tree source that copies ``tree`` (the cached tree itself is never written to)."""
    from functools import partial

    from overlay.maintain.trees import copy_tree

    return partial(copy_tree, tree)
