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

from overlay import digest
from overlay.errors import SeriesError

TRAILER_KEYS = ("Origin", "Bug", "Applied-Upstream", "Last-Update", "Rebased-From")
KERNEL_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9._-]*\.patch$")
_NUMBERED = re.compile(r"^\d{2,}-")
_DIFF_GIT = re.compile(r"^diff --git a/(?P<old>\S+) b/(?P<new>\S+)$")
_HUNK = re.compile(r"^@@ -(?P<os>\d+)(?:,(?P<ol>\d+))? \+(?P<ns>\d+)(?:,(?P<nl>\d+))? @@")
_TRAILER = re.compile(r"^(?P<key>[A-Za-z][A-Za-z0-9-]*): (?P<value>.+)$")


PACKAGE_DIR = "vllm/"
PACKAGE_RULE = ("a patch may change files under vllm/ and, in kernel patches, compiled sources "
                "(csrc/, CMakeLists.txt, *.cu, *.cuh, *.cpp, *.h); take that file out of the patch")


def decode_utf8(raw: bytes, source: str) -> str:
    """``raw`` as text; a non-UTF-8 file is a :class:`SeriesError` naming its line and byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SeriesError(f"{source}:{line}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          "save it as UTF-8") from None


def read_file(path: Path, what: str, fix: str) -> bytes:
    """The bytes of ``path``; a missing, unreadable or directory path is a one-line error."""
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
        raise SeriesError(f"{where}: one patch name per line, got {entry!r}")
    if "/" in entry:
        raise SeriesError(f"{where}: patch name must not contain '/' (a plain file name in the release "
                          f"folder): {entry!r}")
    if _NUMBERED.match(entry):
        raise SeriesError(f"{where}: {entry!r} has a numeric prefix; order lives in the series file")
    if not _NAME.match(entry):
        raise SeriesError(f"{where}: not a patch file name (want 'topic-name.patch'): {entry!r}")


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

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""


def parse_diffs(text: str, source: str, first_line: int = 1) -> tuple[FileDiff, ...]:
    """Split the diff part of a patch into file sections and hunks; ``first_line`` is the line of the
    patch file ``text`` starts at, so every line number (and error) points into that file."""
    files: list[FileDiff] = []
    cur: dict[str, object] | None = None
    hunks: list[Hunk] = []
    added: list[str] = []
    removed: list[str] = []
    old_left = new_left = 0  # body lines of the current hunk still to come

    def close() -> None:
        if cur is not None:
            files.append(FileDiff(cur["old"], cur["new"], cur["line"], tuple(hunks),  # type: ignore[arg-type]
                                  tuple(added), tuple(removed)))

    for lineno, line in enumerate(text.splitlines(), start=first_line):
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
        m = _DIFF_GIT.match(line)
        if m:
            close()
            cur = {"old": m["old"], "new": m["new"], "line": lineno}
            hunks, added, removed = [], [], []
            continue
        if cur is None:
            continue
        if line.startswith("new file mode"):
            cur["old"] = None
        elif line.startswith("deleted file mode"):
            cur["new"] = None
        elif line.startswith("rename from "):
            cur["old"] = line[len("rename from "):]
        elif line.startswith("rename to "):
            cur["new"] = line[len("rename to "):]
        elif line.startswith("@@"):
            h = _HUNK.match(line)
            if not h:
                raise SeriesError(f"{source}:{lineno}: malformed hunk header {line!r} "
                                  "(want '@@ -start,count +start,count @@'); fix or regenerate the patch")
            hunks.append(
                Hunk(int(h["os"]), int(h["ol"] or 1), int(h["ns"]), int(h["nl"] or 1), lineno)
            )
            old_left, new_left = hunks[-1].old_len, hunks[-1].new_len
    close()
    return tuple(files)


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
            raise SeriesError(f"{self.path}: {path}: outside the vllm package; {PACKAGE_RULE}")

    @classmethod
    def from_bytes(cls, name: str, raw: bytes, path: Path) -> Patch:
        """Parse a format-patch file; every problem names the file."""
        source = str(path)
        text = decode_utf8(raw, source)
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
        diff_offset = head_lines + (rest[: max(diff_at, 0) + 1].count("\n") if diff_at >= 0 else 0)
        diff_text = rest[diff_at + 1:] if diff_at >= 0 else rest
        files = parse_diffs(diff_text, source, first_line=diff_offset)  # lines of the patch file
        if not files:
            raise SeriesError(f"{source}: contains no 'diff --git' section")
        return cls(
            name=name, path=path, subject=subject, author=author, body=body.strip(),
            trailers=trailers, files=files, sha256=digest.of_bytes(raw), raw=raw,
        )

    @classmethod
    def load(cls, path: Path) -> Patch:
        raw = read_file(path, "patch file", "remove it, or take it out of the series")
        return cls.from_bytes(path.name, raw, path)

    def check_trailers(self) -> list[str]:
        """Convention problems: missing ``Origin``/``Last-Update``, unknown trailer keys."""
        problems = [f"{self.name}: missing trailer {k!r}" for k in ("Origin", "Last-Update")
                    if k not in self.trailers]
        problems += [f"{self.name}: unknown trailer {k!r}" for k in self.trailers
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
                raise SeriesError(f"{where}: {entry!r} is listed twice")
            names.add(entry)
            entries.append((lineno, entry))
        return entries

    @classmethod
    def load(cls, directory: Path) -> Series:
        """Read ``directory/series`` and every patch it names."""
        series_file = directory / "series"
        if not series_file.exists() and not series_file.is_symlink():
            raise SeriesError(f"{series_file}: no series file")
        raw = read_file(series_file, "series file", "remove it and list the patch names there, one a line")
        text = decode_utf8(raw, str(series_file))
        patches: list[Patch] = []
        for lineno, name in cls.parse_entries(text, str(series_file)):
            path = directory / name
            if path.is_dir():
                raise SeriesError(f"{series_file}:{lineno}: names {name!r}, which is a directory, not a patch file")
            if not path.is_file():
                raise SeriesError(f"{series_file}:{lineno}: names {name!r}, which does not exist")
            patch = Patch.load(path)
            patch.check_package()
            patches.append(patch)
        return cls(directory, tuple(patches))

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

