"""Why a patch of a series does not apply: the base, or an earlier patch of the series.

``git apply`` says only where a hunk failed, and :mod:`overlay.build.apply` used to blame the base
for it. When the patch applies to the base alone, the base is not at fault: an earlier patch changed
those lines first. This module finds that patch, and says whether it already made the same change
(a duplicate: take it out of one of them) or a different one (refresh the later patch on top of it);
it also tells a patch whose change the base already has (upstream took it). Only the failure path
runs it: one ``git apply --check`` per earlier patch at most.
"""

from __future__ import annotations

from pathlib import Path

from overlay.build.series import Patch, is_kernel_path
from overlay.git import git


def why_not(patch: Patch, earlier: tuple[Patch, ...], base: dict[str, bytes], work: Path, label: str, *,
            skip_kernel_files: bool = False) -> str:
    """What to add to the "does not apply to ``label``" line of ``patch``, after ``earlier`` applied to ``base``
    (the touched files' bytes): ``"; <why>"``, or ``""`` when the base is to blame after all. ``work`` is a
    folder that does not exist yet, inside the caller's own scratch folder; it is filled and left there."""
    work.mkdir()
    git(["init", "-q"], work)
    for path, data in base.items():
        dest = work / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    if not _applies(work, patch, skip_kernel_files):
        if _applies(work, patch, skip_kernel_files, reverse=True):
            return (f"; {label} already has this change ({patch.name} reverses cleanly on it): take {patch.name} "
                    "out of the series")
        return ""
    for before in earlier:
        if not _applies(work, before, skip_kernel_files, check=False):
            return ""  # the earlier ones did apply in the caller's run: a base with something else; say no more
        if not _applies(work, patch, skip_kernel_files):
            if _applies(work, patch, skip_kernel_files, reverse=True):
                return (f"; the earlier patch {before.name} already made this change ({patch.name} applies to "
                        f"{label} alone): take the change out of one of them")
            return (f"; the earlier patch {before.name} changes the same lines ({patch.name} applies to {label} "
                    f"alone): refresh {patch.name} on top of it (make workspace)")
    return ""


def _applies(work: Path, patch: Patch, skip_kernel_files: bool, *, reverse: bool = False,
             check: bool = True) -> bool:
    """Whether ``patch`` applies to ``work`` (with ``check``, only tried; else applied)."""
    excluded = [f"--exclude={p}" for p in patch.touched if skip_kernel_files and is_kernel_path(p)]
    args = ["apply", "--whitespace=nowarn", *(["--check"] if check else []), *(["--reverse"] if reverse else []),
            *excluded, "-"]
    return git(args, work, input=patch.raw, check=False).returncode == 0
