"""The only place git runs: argument lists, pinned configuration, ``GitError``.

Every call goes through :func:`git`; no shell strings. The ``-c`` settings make results
independent of the user's git configuration (identity, hooks, colour, rename limits). A value a
user gives (a remote, a ref, a URL) goes through :func:`operand` before it reaches an argument
list, and sits after ``--`` where the git command allows one: git must never read it as an option
(``VLLM_REMOTE='--upload-pack=...'`` would run a command).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from overlay.errors import GitError, UsageError
from overlay.interrupt import bound_to_parent

# Fixed identity and dates so commits made by the tool (scratch trees, workspaces) have
# the same ids for the same inputs; users' global config must not leak in.
_IDENTITY = {
    "GIT_AUTHOR_NAME": "vllm-overlay",
    "GIT_AUTHOR_EMAIL": "overlay@localhost",
    "GIT_COMMITTER_NAME": "vllm-overlay",
    "GIT_COMMITTER_EMAIL": "overlay@localhost",
    "GIT_AUTHOR_DATE": "1980-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "1980-01-01T00:00:00Z",
}

_CONFIG = [
    "-c", "core.autocrlf=false",  # patches are byte-exact; never rewrite line endings
    "-c", "core.fileMode=false",  # wheels carry no meaningful modes for .py files
    "-c", "core.hooksPath=/dev/null",  # no user hooks in scratch repositories
    "-c", "color.ui=never",
    "-c", "commit.gpgSign=false",
    "-c", "diff.renames=true",
    "-c", "merge.renameLimit=0",  # follow renames in large trees (0 = no limit)
    "-c", "diff.renameLimit=0",
    "-c", "init.defaultBranch=main",
    "-c", "advice.detachedHead=false",
    "-c", "am.keepcr=true",
]


def operand(value: str, what: str) -> str:
    """``value`` (a remote, ref or URL a user gave), refused in one line when git could read it as an option.

    The one check for every user value that reaches git: one starting with '-' is never an operand
    (``--upload-pack=CMD`` runs CMD), and one with a control character is no name git takes either.
    """
    if value.startswith("-"):
        raise UsageError(f"{what} {value!r}: starts with '-', which git would read as an option; "
                         "give a remote URL or path, a ref or a commit")
    if not value or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise UsageError(f"{what} {value!r}: empty or holds a control character; not a git remote, ref or commit")
    return value


def git(
    args: list[str],
    repo: Path | None = None,
    *,
    input: bytes | None = None,
    env: dict[str, str] | None = None,
    check: bool = True,
    keep_identity: bool = False,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``git [-C repo] <pinned config> <args>`` and return the completed process.

    Raises :class:`GitError` when git exits non-zero and ``check`` is true.
    """
    cmd = ["git"]
    if repo is not None:
        cmd += ["-C", str(repo)]
    cmd += _CONFIG + args
    full_env = dict(os.environ)
    # Never let an outer repository (GIT_DIR from a hook, say) redirect our calls.
    for key in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        full_env.pop(key, None)
    if not keep_identity:
        full_env.update(_IDENTITY)
    if env:
        full_env.update(env)
    # A fetch (network, minutes for the vLLM remote) dies with the run: it only ever writes into a scratch
    # tree, which the next run removes. Every other step is short and runs to its end, so a repository a
    # killed run leaves is never one with a step cut in half (an index.lock, a half-applied am).
    bound = bound_to_parent() if args[:1] == ["fetch"] else None
    proc = subprocess.run(cmd, input=input, capture_output=True, env=full_env, check=False, preexec_fn=bound)
    if check and proc.returncode != 0:
        raise GitError(args, proc.returncode, proc.stderr.decode(errors="replace"))
    return proc


def git_text(args: list[str], repo: Path | None = None, **kwargs: object) -> str:
    """Run git and return its stdout as text."""
    return git(args, repo, **kwargs).stdout.decode()  # type: ignore[arg-type]


def init_repo(path: Path) -> None:
    """Create an empty repository at ``path`` with the tool's pinned settings."""
    path.mkdir(parents=True, exist_ok=True)
    git(["init", "-q"], path)
