"""Swap a staged distribution into site-packages so that a kill leaves the old or the new one.

A stage is a folder inside site-packages (``.overlay-install/``, same filesystem, invisible to
imports and to ``importlib.metadata``) holding the complete new top-level entries (``vllm/``,
``vllm-<version>.dist-info/``) and the new files that live elsewhere (``bin/vllm``). Staging never
touches the live environment. Once the stage is complete, ``plan.json`` is written (atomically:
its presence means complete), then :func:`commit` puts every entry in place: a live folder is
exchanged with its staged one in one ``renameat2(RENAME_EXCHANGE)``, so ``vllm/`` is at every
instant either the whole old tree or the whole new one. Each step of :func:`commit` checks
(by inode) whether it already happened, so an interrupted commit is finished by running it again:
:func:`recover` does that, or drops a stage without a plan. This guards against kills, not power
loss (nothing is fsynced).

The finished stage (then holding the old tree) is renamed to ``.trash-vllm-overlay-<n>/`` and
removed by a detached ``rm -rf``, off the build's critical path (deleting ~7000 hard links and
~800 folders took 1-2 s of a 5 s edit-to-installed budget); :func:`recover` starts the removal of
any trash a killed removal left.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from overlay.errors import OverlayError

STAGE_NAME = ".overlay-install"
TRASH_PREFIX = ".trash-vllm-overlay-"
PLAN_NAME = "plan.json"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# pip's uninstall stash for vllm (AdjacentTempDirectory's first names): left by a killed pip.
_PIP_STASH = re.compile(r"^~llm(-[^/]*\.dist-info)?$")


class SwapError(OverlayError):
    """A stage or a live entry of the environment is not what an install can work with."""


@dataclass
class Plan:
    """What :func:`commit` puts in place, and what it removes."""

    entries: list[str]  # top-level names in the stage, moved into site-packages in this order
    inodes: dict[str, int]  # staged entry -> its inode, to tell whether it is live yet
    files: dict[str, str] = field(default_factory=dict)  # stage-relative path -> absolute destination
    remove: list[str] = field(default_factory=list)  # site-packages names to take away (old dist-info)
    delete: list[str] = field(default_factory=list)  # absolute paths of old files outside site-packages

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True) + "\n"

    @classmethod
    def read(cls, path: Path) -> Plan:
        try:
            doc = json.loads(path.read_text())
            return cls(entries=list(doc["entries"]), inodes=dict(doc["inodes"]), files=dict(doc["files"]),
                       remove=list(doc["remove"]), delete=list(doc["delete"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SwapError(f"{path}: unreadable install plan ({exc}): remove {path.parent} and build again") from exc


def stage_dir(site: Path) -> Path:
    return site / STAGE_NAME


def new_stage(site: Path) -> Path:
    """An empty stage folder in ``site`` (a leftover one must have been recovered first)."""
    stage = stage_dir(site)
    if stage.exists() or stage.is_symlink():
        raise SwapError(f"{stage}: a stage is already there: build again to finish or drop it")
    stage.mkdir()
    return stage


def seal(stage: Path, plan: Plan) -> None:
    """Mark the stage complete: from here on the install is finished, by this process or the next."""
    for name in plan.entries:
        plan.inodes[name] = os.lstat(stage / name).st_ino
    tmp = stage / (PLAN_NAME + ".tmp")
    tmp.write_text(plan.to_json())
    os.replace(tmp, stage / PLAN_NAME)


def commit(site: Path, stage: Path, plan: Plan, dist_prefix: str) -> None:
    """Put the staged entries in place; idempotent, so a second run finishes an interrupted one."""
    for rel, dest in plan.files.items():
        src = stage / "files" / rel
        if src.exists():
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dest)
    for name in plan.entries:  # the package folders first: they are what `import` sees
        _place(site / name, stage / name, plan.inodes[name])
    trash = stage / "trash"
    trash.mkdir(exist_ok=True)
    stale = [n for n in plan.remove if n not in plan.entries]
    stale += [p.name for p in site.glob(f"{dist_prefix}-*.dist-info") if p.name not in plan.entries]
    stale += [p.name for p in site.iterdir() if _PIP_STASH.match(p.name)]
    for i, name in enumerate(sorted(set(stale))):
        if os.path.lexists(site / name):
            os.rename(site / name, trash / f"{i}-{name}")
    for dest in plan.delete:
        Path(dest).unlink(missing_ok=True)
    (stage / PLAN_NAME).unlink()
    discard(stage)


def discard(folder: Path) -> None:
    """Take ``folder`` (in site-packages) out of the way now and delete it in the background."""
    site = folder.parent
    n = 0
    while os.path.lexists(trash := site / f"{TRASH_PREFIX}{os.getpid()}-{n}"):
        n += 1
    os.rename(folder, trash)
    _remove_in_background(trash)


def _remove_in_background(path: Path) -> None:
    rm = shutil.which("rm")
    argv = [rm, "-rf", "--", str(path)] if rm else [sys.executable, "-c",
                                                   "import shutil, sys; shutil.rmtree(sys.argv[1], True)",
                                                   str(path)]
    try:
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def recover(site: Path, dist_prefix: str) -> str | None:
    """Finish (plan present) or drop (no plan) a stage an interrupted install left; say which, or None."""
    for trash in site.glob(f"{TRASH_PREFIX}*"):  # a removal that was killed: start it again
        _remove_in_background(trash)
    stage = stage_dir(site)
    if not os.path.lexists(stage):
        return None
    if not stage.is_dir() or stage.is_symlink():
        raise SwapError(f"{stage}: is not a folder: remove it and build again")
    plan_path = stage / PLAN_NAME
    if plan_path.exists():
        commit(site, stage, Plan.read(plan_path), dist_prefix)
        return f"finished an interrupted install in {site}"
    shutil.rmtree(stage)
    return f"removed an unfinished install stage {stage} (the environment was not touched)"


def _place(live: Path, staged: Path, inode: int) -> None:
    if _ino(live) == inode:
        return  # done in an earlier run
    if _ino(staged) != inode:
        raise SwapError(f"{staged}: the staged entry is gone and {live} is not it: "
                        f"remove {staged.parent} and build again")
    if not os.path.lexists(live):
        os.rename(staged, live)
    elif live.is_dir() and not live.is_symlink():
        exchange(staged, live)
    else:
        raise SwapError(f"{live}: is not a folder: remove it and build again")


def _ino(path: Path) -> int | None:
    try:
        return os.lstat(path).st_ino
    except FileNotFoundError:
        return None


def exchange(a: Path, b: Path) -> None:
    """Swap two paths in one step (Linux ``renameat2``); two renames where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:
        renameat2 = None
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(b))
    # Fallback: for an instant ``b`` is missing; a kill there is finished by recover().
    parked = a.with_name(a.name + ".old")
    os.rename(b, parked)
    os.rename(a, b)
    os.rename(parked, a)
