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

from overlay import digest, textfile
from overlay.build.diffs import FileDiff, parse_diffs
from overlay.build.pins import INSIDE_PATCHES
from overlay.errors import SeriesError, one_line, shown

TRAILER_KEYS = ("Origin", "Bug", "Applied-Upstream", "Last-Update", "Rebased-From")
KERNEL_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9._-]*\.patch$")
_NUMBERED = re.compile(r"^\d{2,}-")
REGULAR_MODES = "mode 100644 or 100755"
MODE_RULE = "the wheel keeps each file's mode (a new file's is 100644): take the mode change out of the patch"
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

