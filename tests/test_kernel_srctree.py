"""The kernel build's fixed source tree, updated in place from a fresh extraction: unchanged files keep
their mtime, changed ones get a new one, files configure generated there survive (replacing the tree
deleted them and broke the next build: vLLM's marlin ``kernel_selector.h``), dropped files go."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlay.errors import OverlayError
from overlay.kernels.srctree import MANIFEST, sync_tree

REPO = Path(__file__).resolve().parent.parent


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _age(path: Path, seconds: int = 3600) -> None:
    st = path.stat()
    os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


def test_second_sync_touches_only_what_changed_and_keeps_generated_files(tmp_path: Path) -> None:
    base = {"CMakeLists.txt": "project(x)\n", "csrc/a.cu": "a\n", "csrc/b.cu": "b\n", "csrc/gone.cu": "g\n"}
    first = sync_tree(_tree(tmp_path / "fresh1", base), tmp_path / "src")
    assert sorted(first.written) == sorted(base) and first.kept == 0
    src = tmp_path / "src"
    # what configure generates into the tree (not in the extraction)
    _tree(src, {"csrc/quantization/marlin/kernel_selector.h": "// generated\n"})
    for rel in [*base, "csrc/quantization/marlin/kernel_selector.h"]:
        _age(src / rel)
    old = {rel: (src / rel).stat().st_mtime for rel in base}

    edited = {k: v for k, v in base.items() if k != "csrc/gone.cu"} | {"csrc/b.cu": "b, edited\n", "csrc/new.cu": "n\n"}
    second = sync_tree(_tree(tmp_path / "fresh2", edited), src)

    assert sorted(second.written) == ["csrc/b.cu", "csrc/new.cu"]
    assert second.removed == ("csrc/gone.cu",) and second.kept == 2
    assert (src / "csrc/quantization/marlin/kernel_selector.h").read_text() == "// generated\n"
    assert (src / "CMakeLists.txt").stat().st_mtime == old["CMakeLists.txt"]
    assert (src / "csrc/a.cu").stat().st_mtime == old["csrc/a.cu"]
    assert (src / "csrc/b.cu").read_text() == "b, edited\n"
    assert (src / "csrc/b.cu").stat().st_mtime > old["csrc/b.cu"]
    assert not (src / "csrc/gone.cu").exists()
    assert (src / MANIFEST).read_text().splitlines() == sorted(edited)
    assert (tmp_path / "fresh2" / "csrc/b.cu").is_file()  # the extraction is left as it was
    assert not list(src.rglob("*.sync-tmp"))


def test_executable_bit_follows_the_extraction(tmp_path: Path) -> None:
    fresh = _tree(tmp_path / "fresh", {"tools/gen.py": "print()\n"})
    sync_tree(fresh, tmp_path / "src")
    (fresh / "tools/gen.py").chmod(0o755)
    assert sync_tree(fresh, tmp_path / "src").written == ()
    assert os.access(tmp_path / "src/tools/gen.py", os.X_OK)


def test_a_tree_without_the_manifest_is_refused_in_one_line(tmp_path: Path) -> None:
    fresh = _tree(tmp_path / "fresh", {"a.cu": "a\n"})
    _tree(tmp_path / "src", {"mine.txt": "someone's\n"})
    with pytest.raises(OverlayError, match=r"src: a source tree without \.overlay-extracted; remove it"):
        sync_tree(fresh, tmp_path / "src")
    assert (tmp_path / "src/mine.txt").read_text() == "someone's\n"
    with pytest.raises(OverlayError, match="nothere: no extracted source tree"):
        sync_tree(tmp_path / "nothere", tmp_path / "src2")


def test_a_symlink_in_the_extraction_is_refused(tmp_path: Path) -> None:
    fresh = _tree(tmp_path / "fresh", {"a.cu": "a\n"})
    (fresh / "link.cu").symlink_to("/etc/passwd")
    with pytest.raises(OverlayError, match=r"link\.cu: not a regular file"):
        sync_tree(fresh, tmp_path / "src")


def test_the_cli_step_reports_what_it_changed(tmp_path: Path) -> None:
    fresh = _tree(tmp_path / "fresh", {"a.cu": "a\n", "b.cu": "b\n"})
    proc = subprocess.run([sys.executable, "-m", "overlay", "kernels", "sync", "--fresh", str(fresh),
                           "--tree", str(tmp_path / "src")], cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "2 file(s) changed or new (a.cu, b.cu), 0 removed, 0 unchanged" in proc.stderr
