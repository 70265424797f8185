"""Apply a series to a scratch tree that holds only the files the series touches.

The base is read through a callable (a wheel, a directory, a test's dict), the patches
are applied one by one with ``git apply`` (exact context, no fuzz) in a temporary
directory, and the result is the set of changed files. Nothing outside the temporary
directory is written, so a failure leaves every previous output as it was. Errors name
the patch, the file and the hunk, and the earlier patch that changed those lines first
when the base is not at fault (:mod:`overlay.build.blame`).
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from overlay.atomic import scratch
from overlay.build.blame import why_not
from overlay.build.series import PACKAGE_RULE, Patch, is_kernel_path
from overlay.errors import ApplyError, GitError, one_line
from overlay.git import git

BaseReader = Callable[[str], bytes | None]
"""``read(path)`` returns the base file's bytes, or ``None`` when the base has no such file."""


def wheel_reader(zf: zipfile.ZipFile) -> BaseReader:
    """A :data:`BaseReader` over an open wheel (its member list is read once)."""
    members = set(zf.namelist())
    return lambda path: zf.read(path) if path in members else None

_FAILED_AT = re.compile(r"^error: patch failed: (?P<path>.+):(?P<line>\d+)$", re.M)
_CORRUPT = re.compile(r"corrupt patch at line (?P<line>\d+)")
_MISSING = re.compile(r"^error: (?P<path>.+): (?:No such file or directory|does not exist in index)$", re.M)
_EXISTS = re.compile(r"^error: (?P<path>.+): already exists in working directory$", re.M)


@dataclass(frozen=True)
class Applied:
    """The outcome of applying a series: new contents of every changed path."""

    changed: dict[str, bytes]  # path -> new bytes (created or modified files)
    deleted: tuple[str, ...]  # paths the series removes


def _explain(patch: Patch, stderr: str, label: str) -> str:
    """Turn git apply's complaint into one line naming patch, file and hunk."""
    m = _FAILED_AT.search(stderr)
    if m:
        path, line = m["path"], int(m["line"])
        for f in patch.files:
            if f.path == path or f.old_path == path:
                for idx, h in enumerate(f.hunks, start=1):
                    if h.old_start == line:
                        return (
                            f"patch {patch.name}: {path}: hunk #{idx} (@@ -{h.old_start},{h.old_len} "
                            f"at {patch.name}:{h.line}) does not apply to {label}"
                        )
        return f"patch {patch.name}: {path}: hunk at base line {line} does not apply to {label}"
    m = _CORRUPT.search(stderr)
    if m:
        return f"patch {patch.name}: malformed patch at {patch.name}:{m['line']}"
    m = _MISSING.search(stderr)
    if m:
        return f"patch {patch.name}: {m['path']}: file not in {label}"
    m = _EXISTS.search(stderr)
    if m:
        return f"patch {patch.name}: {m['path']}: creates a file that {label} already has"
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return f"patch {patch.name}: does not apply to {label}: {lines[-1] if lines else 'git apply failed'}"


def apply_series(
    patches: tuple[Patch, ...], read_base: BaseReader, label: str = "the base", *, skip_kernel_files: bool = False
) -> Applied:
    """Apply ``patches`` in order to the base files they touch; raise :class:`ApplyError`.

    With ``skip_kernel_files`` the compiled-source parts of kernel patches (``csrc/``, ``*.cu``,
    ...) are left out, so their Python parts can be overlaid on a wheel whose kernels are
    rebuilt elsewhere (``make image``).
    """
    for patch in patches:
        for path in patch.outside_package:
            raise ApplyError(f"patch {patch.name}: {path}: outside the vllm package; {PACKAGE_RULE}")
    touched = sorted({p for patch in patches for p in patch.touched
                      if not (skip_kernel_files and is_kernel_path(p))})
    base: dict[str, bytes] = {}
    for path in touched:
        data = read_base(path)
        if data is not None:
            base[path] = data
    with scratch("overlay-apply-") as tmp:
        root = Path(tmp)
        git(["init", "-q"], root)
        for path, data in base.items():
            dest = root / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        for index, patch in enumerate(patches):
            # Files a patch modifies must exist by now (in the base or from an earlier patch).
            excluded = [p for p in patch.touched if skip_kernel_files and is_kernel_path(p)]
            for f in patch.files:
                if f.old_path and f.old_path not in excluded and not (root / f.old_path).exists():
                    raise ApplyError(f"patch {patch.name}: {f.old_path}: file not in {label}")
            if excluded and len(excluded) == len(patch.touched):
                continue  # nothing of this patch lives in the wheel
            try:
                git(["apply", "--whitespace=nowarn", *(f"--exclude={p}" for p in excluded), "-"], root,
                    input=patch.raw)
            except GitError as exc:  # the base, or an earlier patch that changed those lines first
                raise ApplyError(_explain(patch, exc.stderr, label) + why_not(
                    patch, patches[:index], base, root / ".overlay-blame", label,
                    skip_kernel_files=skip_kernel_files)) from None
        changed: dict[str, bytes] = {}
        deleted: list[str] = []
        for path in touched:
            dest = root / path
            if dest.is_symlink():  # the parser refuses mode 120000; git is the last word on what it made
                raise ApplyError(f"the series makes {one_line(path)} a symbolic link; a patch may only add or "
                                 "change regular files: take it out of the patch")
            if dest.exists():
                data = dest.read_bytes()
                if base.get(path) != data:
                    changed[path] = data
            elif path in base:
                deleted.append(path)
    return Applied(changed, tuple(deleted))
