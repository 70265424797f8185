"""``overlay.atomic``: files and folders replaced whole, with the modes plain writes would give them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from overlay.atomic import replacing_dir, write_file


@pytest.fixture
def umask_022() -> object:
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_write_file_gives_opens_mode_and_replaces(tmp_path: Path, umask_022: object) -> None:
    dest = tmp_path / "report" / "engine.md"
    write_file(dest, "one\n")
    assert dest.read_text() == "one\n"
    assert stat.S_IMODE(dest.stat().st_mode) == 0o644  # mkstemp alone leaves 0600
    write_file(dest, b"two\n")
    assert dest.read_text() == "two\n" and stat.S_IMODE(dest.stat().st_mode) == 0o644
    assert [p.name for p in dest.parent.iterdir()] == ["engine.md"]  # no temporary sibling left


def test_write_file_error_leaves_the_old_file(tmp_path: Path) -> None:
    dest = tmp_path / "baseline.json"
    write_file(dest, "old")
    with pytest.raises(TypeError):
        write_file(dest, 42)  # type: ignore[arg-type]
    assert dest.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["baseline.json"]


def test_replacing_dir_swaps_whole_or_not_at_all(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    with replacing_dir(dest) as tmp:
        (tmp / "a").write_text("a")
    assert (dest / "a").read_text() == "a" and stat.S_IMODE(dest.stat().st_mode) == 0o755
    with pytest.raises(RuntimeError), replacing_dir(dest) as tmp:
        (tmp / "b").write_text("b")
        raise RuntimeError("stop")
    assert sorted(p.name for p in dest.iterdir()) == ["a"] and [p.name for p in tmp_path.iterdir()] == ["out"]
