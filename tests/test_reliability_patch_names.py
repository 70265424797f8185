"""Issue 35 item 4, *the patch parser and git disagree*: every file ``git apply`` would change is a file
the parser sees, so the package rule judges it and the build carries it.

The parser (``overlay.build.series.parse_diffs``) reads names as git's ``apply.c`` does: C-style quoted
names, names with spaces, the ``---``/``+++`` names, rename lines; it refuses a diff git would apply
without a ``diff --git`` line. Each test's docstring says what the code did before.
"""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from overlay.build.diffs import header_name, unquote_c
from overlay.build.pipeline import build
from overlay.build.series import Patch, Series
from overlay.errors import SeriesError
from tests.test_reliability_links import git_patch
from tests.wheelkit import A_PY, BASE_FILES, make_release, make_wheel


def git_paths(raw: bytes, work: Path) -> set[str]:
    """The paths ``git apply`` reads from ``raw`` (``--numstat -z``: a rename gives both)."""
    out = subprocess.run(["git", "apply", "--numstat", "-z", "-"], input=raw, cwd=work, capture_output=True,
                         check=True).stdout.decode("utf-8", errors="backslashreplace")
    tokens, paths = out.split("\0"), set()
    i = 0
    while i < len(tokens) - 1:
        counts = tokens[i].split("\t", 2)
        if counts[2]:
            paths.add(counts[2])
            i += 1
        else:  # a rename: the two names follow
            paths.update(tokens[i + 1:i + 3])
            i += 3
    return paths


NAMES = {
    "non-ascii": "vllm/na\u00efve.py",
    "tab": "vllm/ta\tb.py",
    "quote": 'vllm/quo"te.py',
    "backslash": "vllm/back\\slash.py",
    "newline": "vllm/new\nline.py",
    "space": "vllm/my file.py",
    "space-and-non-ascii": "vllm/my na\u00efve file.py",
}


@pytest.mark.parametrize("name", list(NAMES.values()), ids=list(NAMES))
def test_a_file_git_quotes_or_spaces_is_seen_where_git_sees_it(tmp_path: Path, name: str) -> None:
    """A patch adding ``name`` (under vllm/): the parser's files are git's files.

    Before: ``diff --git "a/..." "b/..."`` (non-ASCII, tab, quote, backslash, newline) and
    ``diff --git a/my file.py b/my file.py`` did not match ``a/(\\S+) b/(\\S+)``: the section was skipped
    and its hunks were counted as the previous file's, or the patch "contained no diff --git section".
    """
    raw = git_patch(tmp_path, {"vllm/a.py": A_PY}, {"vllm/a.py": A_PY + b"x = 1\n", name: b"NEW = 1\n"})
    assert git_paths(raw, tmp_path) == {"vllm/a.py", name}
    patch = Patch.from_bytes("p.patch", raw, tmp_path / "p.patch")
    assert set(patch.touched) == {"vllm/a.py", name}
    (new,) = [f for f in patch.files if f.path == name]
    assert new.old_path is None and new.added == ("NEW = 1",)


@pytest.mark.parametrize("name", ["na\u00efve.py", "my file.py", "setup\t.py", "docs/\u00fcber.md"])
def test_a_quoted_or_spaced_file_outside_the_package_is_refused(tmp_path: Path, name: str) -> None:
    """The package rule sees every file git would change.

    Before: the section was skipped, so ``naïve.py`` at the top of the tree escaped the rule (and was
    created by ``git apply`` wherever the series is applied to a source tree, e.g. the image).
    """
    raw = git_patch(tmp_path, {"vllm/a.py": A_PY}, {"vllm/a.py": A_PY + b"x = 1\n", name: b"x\n"})
    assert name in git_paths(raw, tmp_path)
    d = tmp_path / "rel" / "patches" / "0.28.0"
    d.mkdir(parents=True)
    (d / "p.patch").write_bytes(raw)
    (d / "series").write_text("p.patch\n")
    with pytest.raises(SeriesError, match="outside the vllm package") as exc:
        Series.load(d)
    assert str(exc.value).startswith(f"{d / 'p.patch'}: ")
    assert repr(name) in str(exc.value) or f": {name}: " in str(exc.value)


def test_a_non_ascii_file_reaches_the_wheel(tmp_path: Path) -> None:
    """Before: ``vllm/naïve.py`` was applied by git but not in the parser's files, so the build left it
    out of the wheel without a word (it "silently vanished")."""
    base = tmp_path / "base"
    base.mkdir()
    wheel = make_wheel(base, BASE_FILES)
    raw = git_patch(tmp_path, {"vllm/a.py": A_PY}, {"vllm/a.py": A_PY + b"x = 1\n", "vllm/na\u00efve.py": b"N = 1\n"})
    root = make_release(tmp_path, wheel, patches={"naive.patch": raw})
    res = build(root, "0.28.0", tmp_path / "dist", base_wheel=wheel)
    with zipfile.ZipFile(res.wheel) as zf:
        assert zf.read("vllm/na\u00efve.py") == b"N = 1\n"


def _crafted(tmp_path: Path, edit) -> bytes:
    raw = git_patch(tmp_path, {"vllm/a.py": A_PY}, {"vllm/a.py": A_PY.replace(b"line_5 = 5\n", b"line_5 = 50\n")})
    return edit(raw.decode()).encode()


TRADITIONAL = "--- a/setup.py\n+++ b/setup.py\n@@ -1 +1 @@\n-old\n+new\n"


@pytest.mark.parametrize(("edit", "where"), [
    pytest.param(lambda t: t.replace("--- a/vllm/a.py\n+++ b/vllm/a.py\n", "--- a/setup.py\n+++ b/setup.py\n"),
                 "names", id="other-names-in-the-minus-plus-lines"),
    pytest.param(lambda t: t.replace("\n-- \n", "\n" + TRADITIONAL + "-- \n") if "\n-- \n" in t
                 else t + TRADITIONAL, "traditional", id="a-diff-without-diff-git-after-the-last-hunk"),
    pytest.param(lambda t: t.replace("\nWhy.\n", "\nWhy.\n\n" + TRADITIONAL), "traditional",
                 id="a-diff-without-diff-git-in-the-message"),
])
def test_names_git_takes_from_other_lines_are_judged_too(tmp_path: Path, edit, where: str) -> None:
    """git takes a file's names from its ``---``/``+++`` lines over the ``diff --git`` line, and applies a
    ``---``/``+++``/``@@`` diff that has no ``diff --git`` line at all (after a section, or in the message).

    Before: the parser read only the ``diff --git`` line, so ``setup.py`` was patched by git while the
    parser saw ``vllm/a.py``; a diff without ``diff --git`` was counted as the previous file's hunks or
    not read at all (in the message): either way the package rule never saw ``setup.py``.
    """
    raw = _crafted(tmp_path, edit)
    assert "setup.py" in git_paths(raw, tmp_path)
    if where == "names":
        patch = Patch.from_bytes("p.patch", raw, tmp_path / "p.patch")
        assert patch.touched == ("setup.py",)
        with pytest.raises(SeriesError, match=r"p.patch: setup.py: outside the vllm package"):
            patch.check_package()
    else:
        with pytest.raises(SeriesError, match=r"p.patch:\d+: a file diff without a 'diff --git' line"):
            Patch.from_bytes("p.patch", raw, tmp_path / "p.patch")


def test_lines_are_split_at_newlines_only_as_git_does(tmp_path: Path) -> None:
    """A form feed inside an added line is content (git splits at ``\\n`` only).

    Before: ``str.splitlines`` cut ``+a = 1\\x0c`` into two lines, so the hunk's counts ran out one line
    early and its last added line was dropped from ``added`` (what patch-lint and the image smoke read).
    """
    raw = git_patch(tmp_path, {"vllm/a.py": b"x = 1\n"}, {"vllm/a.py": b"x = 1\na = 1\x0c\nb = 2\n"})
    (f,) = Patch.from_bytes("p.patch", raw, tmp_path / "p.patch").files
    assert f.added == ("a = 1\x0c", "b = 2")


@pytest.mark.parametrize(("quoted", "name"), [
    ('"a/na\\303\\257ve.py"', "a/na\u00efve.py"),
    ('"a/ta\\tb \\"q\\" \\\\ x"', 'a/ta\tb "q" \\ x'),
    ('"a/\\a\\b\\f\\n\\r\\v"', "a/\a\b\f\n\r\v"),
])
def test_unquote_is_gits_c_style(quoted: str, name: str) -> None:
    assert unquote_c(quoted + " rest") == (name, len(quoted))


@pytest.mark.parametrize("bad", ['"a/x', '"a/\\q"', '"a/\\48"', '"a/\\4000"', 'a/x'])
def test_unquote_fails_where_git_fails(bad: str) -> None:
    assert unquote_c(bad) is None


@pytest.mark.parametrize(("rest", "name"), [
    ("a/vllm/x.py b/vllm/x.py", "vllm/x.py"),
    ("a/my file.py b/my file.py", "my file.py"),
    ('"a/na\\303\\257ve.py" "b/na\\303\\257ve.py"', "na\u00efve.py"),
    ('"a/na\\303\\257ve.py" b/na\u00efve.py', "na\u00efve.py"),
    ('a/na\u00efve.py "b/na\\303\\257ve.py"', "na\u00efve.py"),
    ("a/old.py b/new.py", None),  # a rename: its names are on the rename lines
    ('"a/x.py" "b/y.py"', None),
    ("x.py y.py", None),  # no prefix
])
def test_header_name_is_gits(rest: str, name: str | None) -> None:
    assert header_name(rest) == name


@pytest.mark.parametrize("to", ["vllm/my na\u00efve.py", "my na\u00efve.py"], ids=["inside", "outside"])
def test_a_rename_to_a_quoted_name_is_seen(tmp_path: Path, to: str) -> None:
    """``rename from``/``rename to`` with quoted names (a rename's ``diff --git`` names differ, so git reads
    its names there). Before: the section was skipped; a rename out of the package escaped the rule."""
    raw = git_patch(tmp_path, {"vllm/a.py": A_PY}, {to: A_PY}, remove=("vllm/a.py",))
    assert b"\nrename from vllm/a.py\n" in raw
    assert git_paths(raw, tmp_path) == {to}  # numstat names a pure rename by its new name
    patch = Patch.from_bytes("p.patch", raw, tmp_path / "p.patch")
    assert set(patch.touched) == {"vllm/a.py", to}
    assert patch.outside_package == (() if to.startswith("vllm/") else (to,))


def test_replay_reads_hunks_where_the_parser_found_them(tmp_path: Path) -> None:
    """The rebase's hunk signatures index the lines the parser numbered (split at ``\\n`` both).

    Before: both used ``str.splitlines``, which cuts at a form feed too: ``b = 2`` fell out of the hunk.
    """
    from overlay.maintain.replay import hunk_signatures

    raw = git_patch(tmp_path, {"vllm/a.py": b"x = 1\n"}, {"vllm/a.py": b"x = 1\na = 1\x0c\nb = 2\n"})
    ((path, _, removed, added),) = hunk_signatures(raw)
    assert path == "vllm/a.py" and removed == frozenset()
    assert added == {b"a = 1", b"b = 2"}  # stripped, as every signature line is
