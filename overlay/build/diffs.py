"""Parse the ``diff --git`` sections of a patch file as git's apply.c reads them: file names (quoted or
not, traditional or git headers), modes, and hunks with the patch-file line each starts at.

``overlay.build.series`` reads a patch's message and trailers and hands its diff text here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from overlay.errors import SeriesError, shown

# A ``diff --git`` section's extended header lines, as git's apply.c reads them (parse_git_diff_header);
# the first line that is none of these ends the header.
_HEADER_LINES = ("@@ -", "--- ", "+++ ", "old mode ", "new mode ", "deleted file mode ", "new file mode ",
                 "copy from ", "copy to ", "rename old ", "rename new ", "rename from ", "rename to ",
                 "similarity index ", "dissimilarity index ", "index ")
_C_SPACE = " \t\n\v\f\r"  # C's isspace
_C_ESCAPES = {"a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11, "\\": 92, '"': 34}
_MODE = re.compile(r"^[ \t\n\v\f\r]*[+-]?(?P<octal>[0-7]+)")
_INDEX_MODE = re.compile(r"^[0-9a-fA-F]*\.\.[0-9a-fA-F]* (?P<mode>.*)$")
NEW_FILE_MODE = 0o100644  # the mode the wheel gives a file a patch adds (overlay.build.wheel)
_HUNK = re.compile(r"^@@ -(?P<os>\d+)(?:,(?P<ol>\d+))? \+(?P<ns>\d+)(?:,(?P<nl>\d+))? @@")


@dataclass(frozen=True)
class Hunk:
    """One ``@@`` hunk of a file diff; ``line`` is its 1-based line in the patch file."""

    old_start: int
    old_len: int
    new_start: int
    new_len: int
    line: int


@dataclass(frozen=True)
class FileDiff:
    """One ``diff --git`` section."""

    old_path: str | None  # None when the file is created
    new_path: str | None  # None when the file is deleted
    line: int
    hunks: tuple[Hunk, ...]
    added: tuple[str, ...] = ()  # the hunks' '+' lines, without the '+', in order
    removed: tuple[str, ...] = ()  # the hunks' '-' lines, without the '-', in order
    modes: tuple[tuple[int, int], ...] = ()  # (line, mode) of every mode its header gives
    mode_change: tuple[int, int | None, int] | None = None  # (line, old mode, new mode): 'new mode', 'new file mode'

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""

    def irregular_mode(self) -> tuple[int, int] | None:
        """``(line, mode)`` of the first mode that is not a regular file's (a link, a submodule), or None."""
        return next(((n, m) for n, m in self.modes if m & 0o170000 != 0o100000), None)

    def changed_mode(self) -> tuple[int, str] | None:
        """``(line, words)`` when the diff gives the file a mode the wheel would not carry: a ``new mode`` other
        than its ``old mode``, or a new file of a mode other than 100644 (the wheel's members keep the base's
        mode; a new one is written 100644); else None."""
        if self.mode_change is None:
            return None
        line, old, new = self.mode_change
        if self.old_path is None:
            return (line, f"adds it with mode {new:06o}") if new != NEW_FILE_MODE else None
        if old == new:
            return None
        return line, f"changes its mode ({'?' if old is None else f'{old:06o}'} -> {new:06o})"


def unquote_c(text: str) -> tuple[str, int] | None:
    """git's ``unquote_c_style``: the name quoted at the start of ``text`` and the index after its closing
    quote, or None where git fails too. ``\\NNN`` octal escapes are bytes (UTF-8 names: ``\\303\\257`` is
    one character), ``\\t \\n \\" \\\\`` and the other C escapes are what C says."""
    if not text.startswith('"'):
        return None
    out = bytearray()
    i = 1
    while i < len(text):
        ch = text[i]
        if ch == '"':
            return out.decode("utf-8", errors="backslashreplace"), i + 1
        if ch == "\0":
            return None
        if ch != "\\":
            out += ch.encode("utf-8", errors="surrogateescape")
            i += 1
            continue
        esc = text[i + 1:i + 2]
        if esc in _C_ESCAPES:
            out.append(_C_ESCAPES[esc])
            i += 2
        elif esc in ("0", "1", "2", "3") and re.fullmatch(r"[0-7]{3}", text[i + 1:i + 4]):
            out.append(int(text[i + 1:i + 4], 8))
            i += 4
        else:
            return None
    return None


def _strip_prefix(name: str) -> str | None:
    """git's ``skip_tree_prefix`` for ``-p1``: ``name`` after its first ``/`` (``a/``, ``b/``); None without one."""
    at = name.find("/")
    return name[at + 1:] if at > 0 else None


def _squash(name: str) -> str:
    return re.sub("/{2,}", "/", name)


def header_name(rest: str) -> str | None:
    """The one name of ``diff --git <rest>`` as git's ``git_header_name`` reads it: both sides quoted or
    not, and the same path after the prefix (``a/x b/x``, ``"a/na\\303\\257ve.py" "b/na\\303\\257ve.py"``,
    ``a/my file.py b/my file.py``); None where git finds none (a rename's names come from its
    ``rename from``/``rename to`` lines)."""
    if rest.startswith('"'):
        got = unquote_c(rest)
        first = _strip_prefix(got[0]) if got else None
        if got is None or first is None:
            return None
        second = rest[got[1]:].lstrip(_C_SPACE)
        if second.startswith('"'):
            other = unquote_c(second)
            return first if other and _strip_prefix(other[0]) == first else None
        return first if _strip_prefix(second) == first else None
    name = _strip_prefix(rest)
    if name is None:
        return None
    quote = name.find('"')
    if quote >= 0:  # an unquoted first name: a quote starts the second
        got = unquote_c(name[quote:])
        second = _strip_prefix(got[0]) if got else None
        if second is not None and len(second) < quote and name.startswith(second) and name[len(second)] in _C_SPACE:
            return second
        return None
    for at, ch in enumerate(name):  # both unquoted: the name that shows up twice, split at a space or tab
        if ch in " \t" and _strip_prefix(name[at + 1:]) == name[:at]:
            return name[:at]
    return None


def _find_name(text: str, strip: int, tab_ends: bool) -> str | None:
    """git's ``find_name`` for a ``---``/``+++`` line (``strip`` 1, a tab ends the name) or a ``rename``/``copy``
    line (``strip`` 0, the rest of the line): a quoted name unquoted, ``strip`` leading components dropped."""
    if text.startswith('"'):
        got = unquote_c(text)
        if got is not None:
            name: str | None = got[0]
            for _ in range(strip):  # find_name_gnu: each component up to a '/' (a leading one too)
                name = name.split("/", 1)[1] if name is not None and "/" in name else None
            if name is not None:
                return _squash(name)
    start = 0 if strip == 0 else None
    left = strip
    end = len(text)
    for at, ch in enumerate(text):
        if ch == "\n" or (tab_ends and ch == "\t"):
            end = at
            break
        if ch == "/" and left:
            left -= 1
            if not left:
                start = at + 1
    if start is None or start >= end:
        return None
    return _squash(text[start:end])


def _mode(text: str) -> int:
    """An octal mode as git's ``strtoul(.., 8)`` reads it (``0120000`` is a link too); -1 where it reads none."""
    m = _MODE.match(text)
    return int(m["octal"], 8) if m else -1


def _traditional(lines: list[str], i: int) -> bool:
    """Whether ``lines[i]`` starts a diff git applies without a ``diff --git`` line (``---``, ``+++``, ``@@ -``)."""
    return (lines[i].startswith("--- ") and i + 2 < len(lines) and lines[i + 1].startswith("+++ ")
            and lines[i + 2].startswith("@@ -"))


def parse_diffs(text: str, source: str, first_line: int = 1) -> tuple[FileDiff, ...]:
    """Split the diff part of a patch into file sections and hunks; ``first_line`` is the line of the
    patch file ``text`` starts at, so every line number (and error) points into that file.

    Names are read as ``git apply`` reads them (``apply.c``): a C-style quoted name (``"a/na\\303\\257ve.py"``)
    unquoted, a name with spaces found where it shows up twice, the ``---``/``+++`` names taking precedence
    over the ``diff --git`` line's, ``rename``/``copy`` lines. Lines are split at ``\\n`` only, as git does
    (a form feed is content). A diff git would apply without a ``diff --git`` line is refused: every file
    the patch changes is in the result.
    """
    files: list[FileDiff] = []
    cur: dict[str, Any] | None = None
    in_header = False
    hunks: list[Hunk] = []
    added: list[str] = []
    removed: list[str] = []
    modes: list[tuple[int, int]] = []
    old_left = new_left = 0  # body lines of the current hunk still to come

    def close() -> None:
        if cur is None:
            return
        old, new = cur["old"], cur["new"]
        if old is None and new is None:
            if cur["def"] is None:
                raise SeriesError(f"{source}:{cur['line']}: the 'diff --git' line names no file git can read "
                                  "(and no '---'/'+++' or rename line does); fix or regenerate the patch")
            old = new = cur["def"]
        if (new is None and not cur["is_delete"]) or (old is None and not cur["is_new"]):
            raise SeriesError(f"{source}:{cur['line']}: the 'diff --git' section lacks a file name; fix or "
                              "regenerate the patch")
        change = (cur["new_mode"][0], cur.get("old_mode"), cur["new_mode"][1]) if "new_mode" in cur else None
        files.append(FileDiff(None if cur["is_new"] else old, None if cur["is_delete"] else new, cur["line"],
                              tuple(hunks), tuple(added), tuple(removed), tuple(modes), change))

    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for index, line in enumerate(lines):
        lineno = first_line + index
        if old_left > 0 or new_left > 0:  # a hunk's body: counted, so '--- '/'+++ ' text is content here
            tag = line[:1]
            if tag == "\\":  # '\ No newline at end of file'
                continue
            if tag in ("-", " ", ""):
                old_left -= 1
            if tag in ("+", " ", ""):
                new_left -= 1
            if tag == "+":
                added.append(line[1:])
            elif tag == "-":
                removed.append(line[1:])
            continue
        if line.startswith("diff --git "):
            close()
            cur = {"def": header_name(line[len("diff --git "):]), "old": None, "new": None,
                   "is_new": False, "is_delete": False, "line": lineno}
            in_header = True
            hunks, added, removed, modes = [], [], [], []
            continue
        if in_header and cur is not None and line.startswith(_HEADER_LINES) and not line.startswith("@@ -"):
            _header_line(line, lineno, cur, modes)
            continue
        in_header = False
        if not line.startswith("@@") and _traditional(lines, index):
            raise SeriesError(f"{source}:{lineno}: a file diff without a 'diff --git' line ('---', '+++', "
                              "'@@'), which git apply applies too; regenerate the patch with git format-patch")
        if cur is None:
            continue
        if line.startswith("@@"):
            h = _HUNK.match(line)
            if not h:
                raise SeriesError(f"{source}:{lineno}: malformed hunk header {shown(line)} "
                                  "(want '@@ -start,count +start,count @@'); fix or regenerate the patch")
            hunks.append(
                Hunk(int(h["os"]), int(h["ol"] or 1), int(h["ns"]), int(h["nl"] or 1), lineno)
            )
            old_left, new_left = hunks[-1].old_len, hunks[-1].new_len
    close()
    return tuple(files)


def _header_line(line: str, lineno: int, cur: dict[str, Any], modes: list[tuple[int, int]]) -> None:
    """One extended header line of a ``diff --git`` section, as git's ``parse_git_diff_header`` takes it."""
    key = next(k for k in _HEADER_LINES if line.startswith(k))
    rest = line[len(key):]
    if key == "--- ":  # gitdiff_verify_name: a name already known is only checked (git refuses a mismatch)
        if cur["old"] is None and not cur["is_new"]:
            cur["old"] = _find_name(rest, 1, True)
    elif key == "+++ ":
        if cur["new"] is None and not cur["is_delete"]:
            cur["new"] = _find_name(rest, 1, True)
    elif key == "old mode ":
        cur["old_mode"] = _mode(rest)
        modes.append((lineno, cur["old_mode"]))
    elif key == "new mode ":
        cur["new_mode"] = (lineno, _mode(rest))
        modes.append((lineno, _mode(rest)))
    elif key == "deleted file mode ":
        cur["is_delete"] = True
        cur["old"] = cur["def"]
        modes.append((lineno, _mode(rest)))
    elif key == "new file mode ":
        cur["is_new"] = True
        cur["new"] = cur["def"]
        cur["new_mode"] = (lineno, _mode(rest))
        modes.append((lineno, _mode(rest)))
    elif key in ("copy from ", "rename old ", "rename from "):
        cur["old"] = _find_name(rest, 0, False)
    elif key in ("copy to ", "rename new ", "rename to "):
        cur["new"] = _find_name(rest, 0, False)
    elif key == "index ":
        m = _INDEX_MODE.match(rest)
        if m:
            modes.append((lineno, _mode(m["mode"])))
