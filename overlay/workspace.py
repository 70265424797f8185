"""A git working tree for authoring the series: base tree + one commit per patch.

``make workspace`` extracts the pinned wheel's text files into ``.work/<version>/`` as a
``base`` commit and imports every patch with ``git am``; a developer edits there with plain
git; ``make export`` writes the commits back as format-patch files, deterministically
(``--zero-commit --full-index --no-signature --keep-subject --no-stat``), so re-exporting an
unchanged series is byte-identical. The file name of each patch rides along in the commit
message as a ``Patch-Name:`` trailer, which export removes.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

from overlay.errors import GitError, OverlayError, SeriesError
from overlay.fetch import fetch_wheel
from overlay.git import git, git_text
from overlay.pins import load_pin, pin_dir
from overlay.series import Series

NAME_TRAILER = "Patch-Name"
_MAX_TEXT = 4 << 20


def is_text_member(info: zipfile.ZipInfo, head: bytes) -> bool:
    """Text members go into the tree; compiled libraries and executables stay out."""
    return info.file_size <= _MAX_TEXT and b"\0" not in head


def extract_text_tree(wheel: Path, dest: Path) -> int:
    """Extract the wheel's package text files (no dist-info, no binaries) into ``dest``."""
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if name.endswith("/") or ".dist-info/" in name or info.file_size > _MAX_TEXT:
                continue
            data = zf.read(info)
            if not is_text_member(info, data[:8192]):
                continue
            out = dest / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
            count += 1
    return count


def slug(subject: str) -> str:
    """A file name for a new commit without a ``Patch-Name`` trailer."""
    s = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
    return (s[:60].rstrip("-") or "patch") + ".patch"


def create(patches_root: Path, version: str, dest: Path, *, base_wheel: Path | None = None) -> Path:
    """Make ``dest`` a git tree of the base with the series applied as commits."""
    pin = load_pin(patches_root, version)
    series = Series.load(pin_dir(patches_root, version))
    if dest.exists():
        raise OverlayError(f"{dest}: already exists; remove it first or use it as it is")
    wheel = base_wheel or fetch_wheel(pin)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent if dest.parent.exists() else None))
    try:
        extract_text_tree(wheel, tmp)
        git(["init", "-q"], tmp)
        git(["add", "-A"], tmp)
        git(["commit", "-q", "-m", f"vllm {pin.version} (base wheel {pin.sha256[:12]})"], tmp)
        git(["tag", "base"], tmp)
        for patch in series.patches:
            try:
                git(["am", "-q", "--keep-cr", "--keep", "-"], tmp, input=patch.raw)
            except GitError as exc:
                raise SeriesError(f"patch {patch.name}: git am failed: {exc.stderr.strip().splitlines()[0]}") from None
            msg = git_text(["log", "-1", "--format=%B"], tmp).rstrip("\n")
            git(["commit", "-q", "--amend", "-m", f"{msg}\n{NAME_TRAILER}: {patch.name}\n"], tmp,
                env=_author_env(tmp))
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest


def _author_env(repo: Path) -> dict[str, str]:
    """Keep the patch's own author and date when amending."""
    fmt = git_text(["log", "-1", "--format=%an%x00%ae%x00%aI"], repo).strip("\n")
    name, email, date = fmt.split("\0")
    return {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": date}


def format_patch(repo: Path, rev: str) -> bytes:
    """One commit as a deterministic format-patch file."""
    return git(
        [
            "format-patch", "-1", rev, "--stdout",
            "--zero-commit",  # no commit id in the 'From' line: ids change on every re-import
            "--full-index",  # full blob ids, so `git am -3` can always find the preimage
            "--no-signature",  # no trailing git version
            "--keep-subject",  # no '[PATCH n/m]' prefix
            "--no-stat",  # the diffstat only adds churn
            "--no-numbered",
            "--encode-email-headers",
        ],
        repo,
    ).stdout


def export(repo: Path, patches_root: Path, version: str) -> list[str]:
    """Write ``base..HEAD`` of ``repo`` as the series of ``patches/<version>/``."""
    directory = pin_dir(patches_root, version)
    revs = git_text(["rev-list", "--reverse", "base..HEAD"], repo).split()
    names: list[str] = []
    files: dict[str, bytes] = {}
    for rev in revs:
        body = git_text(["log", "-1", "--format=%B", rev], repo)
        m = re.search(rf"^{NAME_TRAILER}: (\S+)$", body, re.M)
        name = m.group(1) if m else slug(git_text(["log", "-1", "--format=%s", rev], repo))
        if name in files:
            raise SeriesError(f"{repo}: two commits want the patch name {name!r}")
        raw = format_patch(repo, rev)
        raw = re.sub(rb"^" + NAME_TRAILER.encode() + rb": \S+\n", b"", raw, count=1, flags=re.M)
        files[name] = raw
        names.append(name)
    series_file = directory / "series"
    old_text = series_file.read_text() if series_file.exists() else ""
    old = Series.parse_names(old_text, str(series_file))
    for name, raw in files.items():
        tmp = directory / f".{name}.tmp"
        tmp.write_bytes(raw)
        os.replace(tmp, directory / name)
    tmp = directory / ".series.tmp"
    tmp.write_text(Series.render(names, header_from=old_text))
    os.replace(tmp, series_file)
    for stale in set(old) - set(names):
        (directory / stale).unlink(missing_ok=True)
    return names
