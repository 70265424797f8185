from __future__ import annotations

import re
from pathlib import Path

import pytest

from overlay.build.series import Patch, Series, is_kernel_path
from overlay.errors import SeriesError
from tests.wheelkit import format_patch

BEFORE = {"vllm/a.py": b"x = 1\ny = 2\n"}
AFTER = {"vllm/a.py": b"x = 1\ny = 3\n"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("0001-fix.patch\n", "has a numeric prefix; order lives in the series file", id="numbered"),
        pytest.param("a.patch\na.patch\n", "'a.patch' is listed twice", id="duplicate"),
        pytest.param("dir/a.patch\n", "must not contain '/'", id="slash"),
        pytest.param("a.diff\n", "not a patch file name", id="suffix"),
        pytest.param("a.patch b.patch\n", "one patch name per line", id="two-on-a-line"),
    ],
)
def test_series_parse_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(SeriesError) as exc:
        Series.parse_names("# header\n\n" + text, "patches/0.28.0/series")
    assert re.match(r"patches/0.28.0/series:[34]: ", str(exc.value))
    assert message in str(exc.value)


def test_comments_and_blank_lines_are_ignored() -> None:
    assert Series.parse_names("# c\n\na.patch  # trailing\n\nb.patch\n", "s") == ["a.patch", "b.patch"]


def test_series_naming_a_missing_patch(tmp_path: Path) -> None:
    (tmp_path / "series").write_text("# c\nthere.patch\nmissing.patch\n")
    (tmp_path / "there.patch").write_bytes(format_patch(BEFORE, AFTER, "Fix y", work=tmp_path))
    with pytest.raises(SeriesError, match=r"series:3: names 'missing.patch', which does not exist$"):
        Series.load(tmp_path)


def test_patch_parsing(tmp_path: Path) -> None:
    raw = format_patch(BEFORE, AFTER, "Fix y so that z",
                       "Origin: vendor\nBug: https://example.org/1\nLast-Update: 2026-11-30", work=tmp_path)
    p = Patch.from_bytes("fix-y.patch", raw, tmp_path / "fix-y.patch")
    assert p.subject == "Fix y so that z"
    assert p.trailers == {"Origin": "vendor", "Bug": "https://example.org/1", "Last-Update": "2026-11-30"}
    assert p.body == "Why it is needed."
    assert p.touched == ("vllm/a.py",)
    assert p.kind == "python"
    assert p.check_trailers() == []
    assert len(p.files[0].hunks) == 1
    assert raw.splitlines()[p.files[0].hunks[0].line - 1].startswith(b"@@ -1,2 +1,2 @@")


def test_rebased_from_is_a_known_trailer(tmp_path: Path) -> None:
    """make status tells a hand port to record ``Rebased-From:``; the convention check must not call it unknown."""
    raw = format_patch(BEFORE, AFTER, "Fix y", "Origin: vendor\nLast-Update: 2026-11-30\nRebased-From: "
                       + "ab" * 32 + "\nFlavour: x", work=tmp_path)
    p = Patch.from_bytes("fix-y.patch", raw, tmp_path / "fix-y.patch")
    assert p.check_trailers() == ["fix-y.patch: unknown trailer 'Flavour'"]


def test_kernel_patch_kind(tmp_path: Path) -> None:
    raw = format_patch({"csrc/x.cu": b"a\n"}, {"csrc/x.cu": b"b\n"}, "Fix kernel", work=tmp_path)
    assert Patch.from_bytes("k.patch", raw, tmp_path / "k.patch").kind == "kernel"


@pytest.mark.parametrize(
    ("path", "kernel"),
    [
        pytest.param("csrc/attention/x.cu", True, id="csrc"),
        pytest.param("CMakeLists.txt", True, id="cmake"),
        pytest.param("vllm/foo.cuh", True, id="cuh"),
        pytest.param("a/b.cpp", True, id="cpp"),
        pytest.param("a/b.h", True, id="h"),
        pytest.param("vllm/v1/attention/ops/dcp_utils.py", False, id="python"),
        pytest.param("vllm/hpp.py", False, id="py-suffix-lookalike"),
    ],
)
def test_is_kernel_path(path: str, kernel: bool) -> None:
    assert is_kernel_path(path) is kernel


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param(b"hello\n", "not a git format-patch file", id="not-mbox"),
        pytest.param(b"From 0 Mon\nSubject: x\n\nno diff here\n", "contains no 'diff --git' section", id="no-diff"),
        pytest.param(b"From 0 Mon\nFrom: a\n\nbody\n", "no 'Subject:' header", id="no-subject"),
        pytest.param(b"\xff\xff", "not UTF-8", id="binary"),  # (FF FE is a UTF-16 byte-order mark, named as one)
    ],
)
def test_patch_parse_errors(tmp_path: Path, raw: bytes, message: str) -> None:
    with pytest.raises(SeriesError, match=message) as exc:
        Patch.from_bytes("bad.patch", raw, tmp_path / "bad.patch")
    assert str(exc.value).startswith(str(tmp_path / "bad.patch"))


def test_malformed_hunk_header_is_named(tmp_path: Path) -> None:
    raw = format_patch(BEFORE, AFTER, "Fix y", work=tmp_path).replace(b"@@ -1,2 +1,2 @@", b"@@ -x +1 @@")
    with pytest.raises(SeriesError, match=r"bad.patch:\d+: malformed hunk header"):
        Patch.from_bytes("bad.patch", raw, tmp_path / "bad.patch")


def test_series_digest_changes_with_content(tmp_path: Path) -> None:
    (tmp_path / "series").write_text("a.patch\n")
    (tmp_path / "a.patch").write_bytes(format_patch(BEFORE, AFTER, "Fix y", work=tmp_path))
    d1 = Series.load(tmp_path).digest("0" * 64)
    assert Series.load(tmp_path).digest("0" * 64) == d1
    assert Series.load(tmp_path).digest("1" * 64) != d1
    (tmp_path / "a.patch").write_bytes(format_patch(BEFORE, {"vllm/a.py": b"x = 1\ny = 4\n"}, "Fix y",
                                                   work=tmp_path))
    assert Series.load(tmp_path).digest("0" * 64) != d1
