from __future__ import annotations

from pathlib import Path

from overlay.git import git, git_text
from overlay.maintain.workspace import create, export
from tests.wheelkit import format_patch, make_release, make_wheel

A = b"".join(f"a{i} = {i}\n".encode() for i in range(20))


def test_workspace_round_trip_is_byte_identical(tmp_path: Path) -> None:
    d = tmp_path / "base"
    d.mkdir()
    wheel = make_wheel(d, {"vllm/a.py": A, "vllm/lib.so": b"\0\1\2" * 100})
    p1 = format_patch({"vllm/a.py": A}, {"vllm/a.py": A.replace(b"a3 = 3", b"a3 = 33")}, "First fix", work=tmp_path)
    root = make_release(tmp_path, wheel, patches={"first.patch": p1})
    ws = create(root, "0.28.0", tmp_path / "ws", base_wheel=wheel)
    assert not (ws / "vllm" / "lib.so").exists()  # binaries stay out of the tree
    assert git_text(["log", "--format=%s", "base..HEAD"], ws).split("\n")[0] == "First fix"
    before = (root / "0.28.0" / "first.patch").read_bytes()
    export(ws, root, "0.28.0")
    assert (root / "0.28.0" / "first.patch").read_bytes() == before  # unchanged series: identical
    # A new commit with a Patch-Name trailer becomes a new series entry.
    (ws / "vllm" / "a.py").write_bytes((ws / "vllm" / "a.py").read_bytes().replace(b"a9 = 9", b"a9 = 99"))
    git(["commit", "-q", "-am", "Second fix\n\nBody.\n\nOrigin: vendor\nLast-Update: 2026-11-30\n"
         "Patch-Name: second.patch\n"], ws)
    assert export(ws, root, "0.28.0") == ["first.patch", "second.patch"]
    text = (root / "0.28.0" / "second.patch").read_text()
    assert "Patch-Name" not in text and text.startswith("From 0000000000000000000000000000000000000000 ")
    assert (root / "0.28.0" / "series").read_text().endswith("first.patch\nsecond.patch\n")
