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
import zipfile
from pathlib import Path

from overlay.atomic import temp_dir, write_file
from overlay.build.fetch import fetch_wheel
from overlay.build.pins import load_pin, pin_dir
from overlay.build.series import Patch, Series, check_patch_name
from overlay.errors import GitError, OverlayError, SeriesError
from overlay.git import git, git_text

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
    s = re.sub(r"[^a-z0-9]+", "-", subject.lower())
    s = re.sub(r"^[^a-z]+", "", s).strip("-")  # a series name starts with a letter: no numeric prefix
    return (s[:60].rstrip("-") or "patch") + ".patch"


def create(patches_root: Path, version: str, dest: Path, *, base_wheel: Path | None = None) -> Path:
    """Make ``dest`` a git tree of the base with the series applied as commits."""
    pin = load_pin(patches_root, version)
    series = Series.load(pin_dir(patches_root, version))
    if dest.exists():
        raise OverlayError(f"{dest}: already exists; remove it first or use it as it is")
    wheel = base_wheel or fetch_wheel(pin)
    # owned: what a killed run left (132 MB for 0.28.0) is removed by the next
    with temp_dir(dest.parent, ".workspace-", legacy=(f".{dest.name}-",)) as tmp:
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
        os.replace(tmp, dest)
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


_IGNORED_DIRT = re.compile(r"(^|/)__pycache__(/|$)|\.py[co]$")
_DIRT_SHOWN = 10


def uncommitted(repo: Path) -> list[str]:
    """Paths with uncommitted or untracked changes (``__pycache__`` and ``*.pyc`` left aside)."""
    records = git_text(["status", "--porcelain=v1", "-z", "--untracked-files=all"], repo).split("\0")
    paths: list[str] = []
    skip = False
    for rec in records:
        if skip or not rec:
            skip = False
            continue
        status, path = rec[:2], rec[3:]
        skip = status[0] in "RC"  # a rename's or copy's source follows as its own record
        if not _IGNORED_DIRT.search(path):
            paths.append(path)
    return sorted(paths)


def check_clean(repo: Path) -> None:
    """Refuse to export while edits in ``repo`` are not committed: export writes commits only."""
    dirty = uncommitted(repo)
    if not dirty:
        return
    shown = ", ".join(dirty[:_DIRT_SHOWN]) + (f" and {len(dirty) - _DIRT_SHOWN} more" if len(dirty) > _DIRT_SHOWN
                                               else "")
    raise OverlayError(f"{repo}: uncommitted changes would not be exported: {shown}; commit them "
                       f"(git -C {repo} commit -a, git add for new files) or drop them, "
                       "or export only the commits with --allow-dirty")


def _export_name(repo: Path, rev: str) -> str:
    """The patch file name of one commit: its ``Patch-Name:`` trailer (checked as a series line), or a slug."""
    body = git_text(["log", "-1", "--format=%B", rev], repo)
    m = re.search(rf"^{NAME_TRAILER}: (.+?)\s*$", body, re.M)
    if not m:
        return slug(git_text(["log", "-1", "--format=%s", rev], repo))
    name = m.group(1)
    where = f"{repo}: commit {rev[:12]} {NAME_TRAILER}"
    try:
        check_patch_name(name, where)
    except SeriesError as exc:
        raise SeriesError(f"{exc}; fix the commit's {NAME_TRAILER}: trailer (git rebase -i base, reword)") from None
    return name


def export(repo: Path, patches_root: Path, version: str, *, allow_dirty: bool = False) -> list[str]:
    """Write ``base..HEAD`` of ``repo`` as the series of ``patches/<version>/``.

    Uncommitted or untracked edits in ``repo`` are refused unless ``allow_dirty`` (then only the
    commits are exported). Every name and patch is checked as ``make build`` checks it before
    anything is written.
    """
    directory = pin_dir(patches_root, version)
    if not allow_dirty:
        check_clean(repo)
    revs = git_text(["rev-list", "--reverse", "base..HEAD"], repo).split()
    names: list[str] = []
    files: dict[str, bytes] = {}
    for rev in revs:
        name = _export_name(repo, rev)
        if name in files:
            raise SeriesError(f"{repo}: two commits want the patch name {name!r}")
        raw = format_patch(repo, rev)
        raw = re.sub(rb"^" + NAME_TRAILER.encode() + rb": .*\n", b"", raw, count=1, flags=re.M)
        Patch.from_bytes(name, raw, directory / name).check_package()
        files[name] = raw
        names.append(name)
    series_file = directory / "series"
    old_text = series_file.read_text() if series_file.exists() else ""
    old = Series.parse_names(old_text, str(series_file))
    for name, raw in files.items():
        write_file(directory / name, raw)
    write_file(series_file, Series.render(names, header_from=old_text))
    for stale in set(old) - set(names):
        (directory / stale).unlink(missing_ok=True)
    return names
