"""``Patch`` and ``Series``: parse a ``series`` file and the format-patch files it names.

A patch file is ``git format-patch`` output (exported with ``--zero-commit --keep-subject
--no-signature``). Its message ends in DEP-3-style trailers (``Origin:``, ``Bug:``,
``Applied-Upstream:``, ``Last-Update:``). A patch is ``kernel`` when it touches compiled
sources (``csrc/``, ``CMakeLists.txt``, ``*.cu``, ``*.cuh``, ``*.cpp``, ``*.h``), else ``python``.
"""

from __future__ import annotations

import email.header
import email.parser
import email.policy
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overlay import digest, textfile
from overlay.build.pins import INSIDE_PATCHES
from overlay.errors import SeriesError, one_line, shown

TRAILER_KEYS = ("Origin", "Bug", "Applied-Upstream", "Last-Update", "Rebased-From")
KERNEL_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9._-]*\.patch$")
_NUMBERED = re.compile(r"^\d{2,}-")
# A ``diff --git`` section's extended header lines, as git's apply.c reads them (parse_git_diff_header);
# the first line that is none of these ends the header.
_HEADER_LINES = ("@@ -", "--- ", "+++ ", "old mode ", "new mode ", "deleted file mode ", "new file mode ",
                 "copy from ", "copy to ", "rename old ", "rename new ", "rename from ", "rename to ",
                 "similarity index ", "dissimilarity index ", "index ")
_C_SPACE = " \t\n\v\f\r"  # C's isspace
_C_ESCAPES = {"a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11, "\\": 92, '"': 34}
_MODE = re.compile(r"^[ \t\n\v\f\r]*[+-]?(?P<octal>[0-7]+)")
_INDEX_MODE = re.compile(r"^[0-9a-fA-F]*\.\.[0-9a-fA-F]* (?P<mode>.*)$")
REGULAR_MODES = "mode 100644 or 100755"
NEW_FILE_MODE = 0o100644  # the mode the wheel gives a file a patch adds (overlay.build.wheel)
MODE_RULE = "the wheel keeps each file's mode (a new file's is 100644): take the mode change out of the patch"
_HUNK = re.compile(r"^@@ -(?P<os>\d+)(?:,(?P<ol>\d+))? \+(?P<ns>\d+)(?:,(?P<nl>\d+))? @@")
_OWN_LINES = ("From ", "diff --git ", "@@ ")  # lines of the patch itself, never a hunk's content
_TRAILER = re.compile(r"^(?P<key>[A-Za-z][A-Za-z0-9-]*): (?P<value>.+)$")


PACKAGE_DIR = "vllm/"
PACKAGE_RULE = ("a patch may change files under vllm/ and, in kernel patches, compiled sources "
                "(csrc/, CMakeLists.txt, *.cu, *.cuh, *.cpp, *.h); take that file out of the patch")


def decode_utf8(raw: bytes, source: str) -> str:
    """``raw`` as text (:func:`overlay.textfile.decode`): a byte-order mark or bytes that are not UTF-8 are a
    :class:`SeriesError` naming the file (and the line and byte)."""
    return textfile.decode(raw, source, SeriesError)


def read_file(path: Path, what: str, fix: str, inside: Path) -> bytes:
    """The bytes of ``path``, a file in the folder ``inside`` (its links followed: one out of it is refused
    unread); a missing, unreadable or directory path is a one-line error."""
    textfile.refuse_link_out(path, inside, SeriesError, INSIDE_PATCHES)
    if path.is_dir():
        raise SeriesError(f"{path}: is a directory, not a {what}; {fix}")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise SeriesError(f"{path}: {what} not found") from None
    except OSError as exc:
        raise SeriesError(f"{path}: cannot read {what}: {exc.strerror}") from None


def check_patch_name(entry: str, where: str) -> None:
    """The rules for a patch file name (a series line, an exported ``Patch-Name:``); errors start with ``where``."""
    if " " in entry or "\t" in entry:
        raise SeriesError(f"{where}: one patch name per line, got {shown(entry)}")
    if "/" in entry:
        raise SeriesError(f"{where}: patch name must not contain '/' (a plain file name in the release "
                          f"folder): {shown(entry)}")
    if _NUMBERED.match(entry):
        raise SeriesError(f"{where}: {shown(entry)} has a numeric prefix; order lives in the series file")
    if not _NAME.match(entry):
        raise SeriesError(f"{where}: not a patch file name (want 'topic-name.patch'): {shown(entry)}")


def is_package_path(path: str) -> bool:
    """True for paths a patch may touch: the ``vllm/`` package (no ``..``), or compiled sources."""
    parts = path.split("/")
    if path.startswith("/") or any(part in ("", ".", "..") for part in parts):
        return False
    return path.startswith(PACKAGE_DIR) or is_kernel_path(path)


def is_kernel_path(path: str) -> bool:
    """True for files that live in compiled extensions (rebuilt only by ``make image``)."""
    name = path.rsplit("/", 1)[-1]
    return path.startswith("csrc/") or "/csrc/" in path or name == "CMakeLists.txt" or name.endswith(
        KERNEL_SUFFIXES
    )


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


@dataclass(frozen=True)
class Patch:
    """One patch file of a series, parsed."""

    name: str
    path: Path
    subject: str
    author: str
    body: str
    trailers: dict[str, str]
    files: tuple[FileDiff, ...]
    sha256: str
    raw: bytes = field(repr=False)

    @property
    def origin(self) -> str:
        return self.trailers.get("Origin", "")

    @property
    def bug(self) -> str:
        return self.trailers.get("Bug", "")

    @property
    def applied_upstream(self) -> str:
        return self.trailers.get("Applied-Upstream", "")

    @property
    def touched(self) -> tuple[str, ...]:
        """Every path the patch reads or writes, sorted, without duplicates."""
        paths = {p for f in self.files for p in (f.old_path, f.new_path) if p}
        return tuple(sorted(paths))

    @property
    def kind(self) -> str:
        return "kernel" if any(is_kernel_path(p) for p in self.touched) else "python"

    @property
    def outside_package(self) -> tuple[str, ...]:
        """Touched paths that are neither in the ``vllm/`` package nor compiled sources."""
        return tuple(p for p in self.touched if not is_package_path(p))

    def check_package(self) -> None:
        """Refuse a patch that touches files outside the package (they would land in site-packages)."""
        for path in self.outside_package:
            raise SeriesError(f"{self.path}: {one_line(path)}: outside the vllm package; {PACKAGE_RULE}")

    @classmethod
    def from_bytes(cls, name: str, raw: bytes, path: Path) -> Patch:
        """Parse a format-patch file; every problem names the file."""
        source = str(path)
        text = decode_utf8(raw, source)
        # git format-patch writes LF; a converted file's own lines end in CR LF (not a hunk's content)
        textfile.refuse_empty(text, source, SeriesError, "a git format-patch file")
        textfile.refuse_crlf(text, source, SeriesError, _OWN_LINES)
        if not text.startswith("From "):
            raise SeriesError(f"{source}: not a git format-patch file (no 'From ' line)")
        head, sep, rest = text.partition("\n\n")
        if not sep:
            raise SeriesError(f"{source}: no blank line after the mail headers")
        msg = email.parser.HeaderParser(policy=email.policy.compat32).parsestr(
            head.split("\n", 1)[1] + "\n\n"
        )
        subject_raw = msg.get("Subject")
        if not subject_raw:
            raise SeriesError(f"{source}: no 'Subject:' header")
        subject = str(email.header.make_header(email.header.decode_header(subject_raw)))
        subject = " ".join(subject.split())
        subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject)
        author = str(email.header.make_header(email.header.decode_header(msg.get("From", ""))))
        diff_at = rest.find("\ndiff --git ")
        if not rest.startswith("diff --git ") and diff_at < 0:
            raise SeriesError(f"{source}: contains no 'diff --git' section")
        message = "" if rest.startswith("diff --git ") else rest[:diff_at]
        # The commit message ends at the '---' line before the diffstat, if there is one.
        message = re.split(r"^---$", message, maxsplit=1, flags=re.M)[0].strip("\n")
        paragraphs = [p for p in re.split(r"\n\s*\n", message) if p.strip()]
        trailers: dict[str, str] = {}
        body = message
        if paragraphs:
            last = paragraphs[-1].splitlines()
            parsed = [_TRAILER.match(line) for line in last]
            if all(parsed):
                for m in parsed:
                    assert m is not None
                    trailers[m["key"]] = m["value"].strip()
                body = "\n\n".join(paragraphs[:-1])
        head_lines = head.count("\n") + 3  # the first line of `rest`
        # The message too: git apply reads a diff wherever it is (parse_diffs refuses one without 'diff --git').
        files = parse_diffs(rest, source, first_line=head_lines)  # lines of the patch file
        if not files:
            raise SeriesError(f"{source}: contains no 'diff --git' section")
        for f in files:
            irregular = f.irregular_mode()
            if irregular is not None:
                lineno, mode = irregular
                kind = {0o120000: "a symbolic link", 0o160000: "a submodule"}.get(mode & 0o170000, "not a file")
                raise SeriesError(f"{source}:{lineno}: {one_line(f.path)}: mode {mode:06o} ({kind}); a patch may "
                                  f"only add or change regular files ({REGULAR_MODES}): take it out of the patch")
            changed = f.changed_mode()
            if changed is not None:  # dropped without a word before: a mode-only patch changed no byte
                raise SeriesError(f"{source}:{changed[0]}: {one_line(f.path)}: {changed[1]}; {MODE_RULE}")
        return cls(
            name=name, path=path, subject=subject, author=author, body=body.strip(),
            trailers=trailers, files=files, sha256=digest.of_bytes(raw), raw=raw,
        )

    @classmethod
    def load(cls, path: Path, inside: Path | None = None) -> Patch:
        """Read and parse ``path``, a file in the folder ``inside`` (default: its own folder)."""
        raw = read_file(path, "patch file", "remove it, or take it out of the series", inside or path.parent)
        return cls.from_bytes(path.name, raw, path)

    def check_trailers(self) -> list[str]:
        """Convention problems: missing ``Origin``/``Last-Update``, unknown trailer keys."""
        problems = [f"{self.name}: missing trailer {k!r}" for k in ("Origin", "Last-Update")
                    if k not in self.trailers]
        problems += [f"{self.name}: unknown trailer {shown(k)}" for k in self.trailers
                     if k not in TRAILER_KEYS and k not in ("Signed-off-by", "Co-authored-by")]
        return problems


@dataclass(frozen=True)
class Series:
    """The ordered patches of one release folder (``patches/<version>/``)."""

    directory: Path
    patches: tuple[Patch, ...]

    @property
    def series_file(self) -> Path:
        return self.directory / "series"

    @staticmethod
    def render(names: list[str], header_from: str = "") -> str:
        """Series file text: the comment lines of ``header_from`` (an old series file's text), then
        one patch name per line."""
        header = "".join(line + "\n" for line in header_from.splitlines() if line.lstrip().startswith("#"))
        return header + "".join(f"{n}\n" for n in names)

    @staticmethod
    def parse_names(text: str, source: str) -> list[str]:
        """Patch names in order; '#' starts a comment; errors name the line."""
        return [name for _, name in Series.parse_entries(text, source)]

    @staticmethod
    def parse_entries(text: str, source: str) -> list[tuple[int, str]]:
        """``(line number, patch name)`` in order; errors name the line."""
        entries: list[tuple[int, str]] = []
        names: set[str] = set()
        for lineno, line in enumerate(text.splitlines(), start=1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            where = f"{source}:{lineno}"
            check_patch_name(entry, where)
            if entry in names:
                raise SeriesError(f"{where}: {shown(entry)} is listed twice")
            names.add(entry)
            entries.append((lineno, entry))
        return entries

    @classmethod
    def load(cls, directory: Path) -> Series:
        """Read ``directory/series`` and every patch it names."""
        series_file = directory / "series"
        if not series_file.exists() and not series_file.is_symlink():
            raise SeriesError(f"{series_file}: no series file")
        # the patches folder: a release's files may link to another release's, never out of it
        patches_root = directory.parent
        raw = read_file(series_file, "series file", "remove it and list the patch names there, one a line",
                        patches_root)
        text = decode_utf8(raw, str(series_file))
        patches: list[Patch] = []
        for lineno, name in cls.parse_entries(text, str(series_file)):
            path = directory / name
            textfile.refuse_link_out(path, patches_root, SeriesError, INSIDE_PATCHES)
            if path.is_dir():
                raise SeriesError(f"{series_file}:{lineno}: names {shown(name)}, which is a directory, "
                                  "not a patch file")
            if not path.is_file():
                raise SeriesError(f"{series_file}:{lineno}: names {shown(name)}, which does not exist")
            patch = Patch.load(path, patches_root)
            patch.check_package()
            patches.append(patch)
        return cls(directory, tuple(patches))

    def require_patches(self, why: str) -> Series:
        """``self`` when it lists a patch; else a :class:`SeriesError` naming the series file and ``why`` an
        empty one cannot be meant (for a pinned release it is a mistake: a lost file, a bad merge)."""
        if not self.patches:
            raise SeriesError(f"{self.series_file}: lists no patch (only blank lines and comments): {why}; list "
                              "the patches there, one file name a line")
        return self

    @property
    def kernel_patches(self) -> tuple[Patch, ...]:
        return tuple(p for p in self.patches if p.kind == "kernel")

    @property
    def kernel_touched(self) -> tuple[str, ...]:
        """Every path the kernel patches touch, sorted, without duplicates."""
        return tuple(sorted({p for patch in self.kernel_patches for p in patch.touched}))

    def digest(self, base_sha256: str) -> str:
        """sha256 over the base wheel digest and each patch's name and digest, in order."""
        h = hashlib.sha256()
        h.update(f"base {base_sha256}\n".encode())
        for p in self.patches:
            h.update(f"patch {p.name} {p.sha256}\n".encode())
        return h.hexdigest()

