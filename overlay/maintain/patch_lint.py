"""``make patch-lint``: the lines our patches add, checked the way vLLM checks its own code.

A patch should be proposable upstream as it is, so its Python must pass the release's own
pre-commit ruff hooks: ``ruff check`` and ``ruff format`` with the release's ``pyproject.toml``
(from its verified sdist), run by the ruff version its ``.pre-commit-config.yaml`` pins (installed
once with pip into ``<cache>/tools/ruff-<version>/``).

The base files the series touches are committed into a scratch git repository, each patch is
applied on top as one commit, and ``git blame`` maps every line of the result to the patch that
wrote it. Findings on lines of the base are the release's own and are left out; every other one
is printed as ``<patch>: <file>:<line>: <code> <message>`` (formatting: the lines ruff format would
rewrite). Exit 0 clean, 1 findings; :class:`PatchLintError` (exit 2) for a broken harness.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from overlay.atomic import child_tmpdir, scratch, temp_dir
from overlay.build.pins import load_pin, pin_dir
from overlay.build.series import Series
from overlay.errors import OverlayError
from overlay.git import git, git_text
from overlay.interrupt import bound_to_parent

RUFF_HOOKS = "astral-sh/ruff-pre-commit"


class PatchLintError(OverlayError):
    """The lint could not run (no sdist pinned, no ruff hook in the release, pip failed)."""


@dataclass(frozen=True)
class Finding:
    patch: str
    path: str
    line: int
    code: str
    message: str

    def __str__(self) -> str:
        return f"{self.patch}: {self.path}:{self.line}: {self.code} {self.message}"


_RELEASE = re.compile(r"v?\d+\.\d+\.\d+")
_FROZEN = re.compile(r"^\s*rev:\s*([0-9a-f]{40})\s*#\s*frozen:\s*(\S+)\s*$", re.M)


def ruff_version(precommit: str, source: str) -> str:
    """The ruff version a ``.pre-commit-config.yaml`` pins: ``rev: v0.14.0`` of ruff-pre-commit, or a rev
    frozen to a commit with the version in pre-commit's own comment (``rev: f368fb3...  # frozen: v0.17.2``,
    ``pre-commit autoupdate --freeze``; vLLM 0.34.0), which YAML drops, so it is read from the line."""
    try:
        doc = yaml.safe_load(precommit) or {}
    except yaml.YAMLError as exc:
        raise PatchLintError(f"{source}: not readable YAML: {exc}") from None
    frozen = {sha: version for sha, version in _FROZEN.findall(precommit)}
    for repo in doc.get("repos") or []:
        if isinstance(repo, dict) and str(repo.get("repo", "")).rstrip("/").endswith(RUFF_HOOKS):
            rev = str(repo.get("rev", ""))
            if rev in frozen:
                if not _RELEASE.fullmatch(frozen[rev]):
                    raise PatchLintError(f"{source}: {RUFF_HOOKS} rev {rev[:12]} is frozen at {frozen[rev]!r}, "
                                         "not a release version")
                return frozen[rev].lstrip("v")
            if not _RELEASE.fullmatch(rev):
                raise PatchLintError(f"{source}: {RUFF_HOOKS} rev {rev!r} is not a release version"
                                     + (" (a commit without a `# frozen: vX.Y.Z` comment)"
                                        if re.fullmatch(r"[0-9a-f]{40}", rev) else ""))
            return rev.lstrip("v")
    raise PatchLintError(f"{source}: no {RUFF_HOOKS} hook: the release does not lint with ruff")


def ensure_ruff(version: str, cache: Path) -> Path:
    """``<cache>/tools/ruff-<version>/bin/ruff``, installed with pip on first use (atomically)."""
    dest = cache / "tools" / f"ruff-{version}"
    exe = dest / "bin" / "ruff"
    if exe.is_file():
        return exe
    with temp_dir(dest.parent, ".install-", legacy=(f".{dest.name}-",)) as tmp:  # a killed run's: removed by the next
        print(f"patch-lint: installing ruff {version} (the release's pre-commit version) ...", file=sys.stderr,
              flush=True)
        with child_tmpdir() as env:
            done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                   "--no-deps", "--target", str(tmp), f"ruff=={version}"],
                                  capture_output=True, text=True, env=env, preexec_fn=bound_to_parent())
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise PatchLintError(f"pip install ruff=={version}: {last}")
        if not (tmp / "bin" / "ruff").is_file():
            raise PatchLintError(f"pip install ruff=={version}: no bin/ruff in what it installed")
        os.replace(tmp, dest)
    return exe


def _commit_series(repo: Path, series: Series, base: Path) -> dict[str, str]:
    """The base files, then one commit per patch; returns commit sha -> patch name."""
    touched = sorted({p for patch in series.patches for p in patch.touched})
    git(["init", "-q"], repo)
    # The packages' __init__.py too (not linted): ruff's isort knows `vllm` as first-party by them.
    inits = {str(Path(*Path(rel).parts[:n]) / "__init__.py") for rel in touched for n in range(1, len(Path(rel).parts))}
    for rel in sorted(set(touched) | inits):
        if (base / rel).is_file():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(base / rel, repo / rel)
    ident = ["-c", "user.name=patch-lint", "-c", "user.email=patch-lint@localhost"]
    git(["add", "-A"], repo)
    git([*ident, "commit", "-q", "--allow-empty", "-m", "base"], repo)
    owners: dict[str, str] = {}
    for patch in series.patches:
        git(["apply", "--whitespace=nowarn", "-"], repo, input=patch.raw)
        git(["add", "-A"], repo)
        git([*ident, "commit", "-q", "--allow-empty", "-m", patch.name], repo)
        owners[git_text(["rev-parse", "HEAD"], repo).strip()] = patch.name
    return owners


def line_owners(repo: Path, rel: str, owners: dict[str, str]) -> dict[int, str]:
    """Line number -> the patch that wrote it (lines of the base are absent)."""
    out: dict[int, str] = {}
    sha = ""
    for row in git_text(["blame", "--porcelain", "HEAD", "--", rel], repo).splitlines():
        head = row.split(" ")
        if len(head) >= 3 and re.fullmatch(r"[0-9a-f]{40}", head[0]):
            sha = head[0]
            if sha in owners:
                out[int(head[2])] = owners[sha]
    return out


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@")


def format_regions(diff: str) -> dict[str, list[tuple[int, int]]]:
    """From ``ruff format --diff``: per file, the (first, last) original lines each hunk rewrites.

    A hunk that only inserts lines is placed on the line before the insertion.
    """
    out: dict[str, list[tuple[int, int]]] = {}
    path = ""
    line = 0
    first = last = 0
    in_hunk = False

    def close() -> None:
        if in_hunk and path:
            out.setdefault(path, []).append((first or max(line - 1, 1), last or max(line - 1, 1)))

    for row in diff.splitlines():
        if row.startswith("--- "):
            close()
            in_hunk = False
            path = row[4:].strip()
        elif row.startswith("+++ "):
            continue
        elif m := _HUNK.match(row):
            close()
            in_hunk, line, first, last = True, int(m.group(1)), 0, 0
        elif in_hunk and row.startswith("-"):
            first = first or line
            last = line
            line += 1
        elif in_hunk and row.startswith("+"):
            if not first:
                first = last = max(line - 1, 1)
        elif in_hunk and (row.startswith(" ") or row == ""):
            line += 1
    close()
    return out


def lint_tree(repo: Path, owners: dict[str, str], files: list[str], ruff: Path) -> list[Finding]:
    """Run ``ruff check`` and ``ruff format --diff`` (config: ``repo/pyproject.toml``) on ``files``."""
    if not files:
        return []
    config = ["--config", str(repo / "pyproject.toml")]
    check = subprocess.run([str(ruff), "check", "--no-cache", "--no-fix", "--output-format", "json", *config,
                            *files], cwd=repo, capture_output=True, text=True)
    if check.returncode not in (0, 1):
        raise PatchLintError(f"ruff check: {(check.stderr.strip().splitlines() or ['failed'])[-1]}")
    fmt = subprocess.run([str(ruff), "format", "--no-cache", "--diff", *config, *files], cwd=repo,
                         capture_output=True, text=True)
    blamed = {rel: line_owners(repo, rel, owners) for rel in files}
    found: set[Finding] = set(_unparsable(fmt.stderr, repo, blamed)) if fmt.returncode not in (0, 1) else set()
    if fmt.returncode not in (0, 1) and not found:
        raise PatchLintError(f"ruff format: {(fmt.stderr.strip().splitlines() or ['failed'])[-1]}")
    for item in json.loads(check.stdout or "[]"):
        rel = os.path.relpath(item["filename"], repo)
        row = int(item["location"]["row"])
        patch = blamed.get(rel, {}).get(row)
        if patch:
            found.add(Finding(patch, rel, row, item.get("code") or "ruff", item["message"]))
    for rel, regions in format_regions(fmt.stdout).items():
        for first, last in regions:
            patches = sorted({blamed.get(rel, {}).get(n) for n in range(first, last + 1)} - {None})
            for patch in patches:
                span = f"lines {first}-{last}" if last > first else f"line {first}"
                found.add(Finding(patch, rel, first, "format", f"ruff format would rewrite {span}"))
    return sorted(found, key=lambda f: (f.patch, f.path, f.line, f.code))


_PARSE_ERROR = re.compile(r"Failed to parse (?P<file>.+?):(?P<line>\d+):(?P<col>\d+): (?P<why>.+)$")


def _unparsable(stderr: str, repo: Path, blamed: dict[str, dict[int, str]]) -> list[Finding]:
    """``ruff format``'s "Failed to parse FILE:LINE:COL: why" as findings of the patch owning the line.

    A file ruff cannot parse is not formatted at all, so without this its syntax error showed only
    as ruff's last line ("N files already formatted"). A line no patch owns is the base's: an error.
    """
    found = []
    for m in map(_PARSE_ERROR.search, stderr.splitlines()):
        if not m:
            continue
        rel, line = os.path.relpath(repo / m["file"], repo), int(m["line"])
        patch = blamed.get(rel, {}).get(line)
        if patch is None:
            raise PatchLintError(f"ruff format: {rel}:{line}:{m['col']}: syntax error in a line no patch adds: "
                                 f"{m['why']}")
        found.append(Finding(patch, rel, line, "syntax-error", f"{m['why']} (column {m['col']})"))
    return found


def run(patches_root: Path, version: str, *, cache: Path | None = None) -> list[Finding]:
    from overlay.build.fetch import cache_dir
    from overlay.build.sdist import fetch_sdist, pip_url_download_sdist, read_sources
    from overlay.maintain.trees import base_tree

    cache = cache or cache_dir()
    pin = load_pin(patches_root, version)
    if not pin.sdist:
        raise PatchLintError(f"{pin_dir(patches_root, version) / 'pin.toml'}: no sdist pinned (sdist, "
                             "sdist_sha256): the release's lint settings come from its source archive")
    series = Series.load(pin_dir(patches_root, version))
    sdist = fetch_sdist(pin, str(pin_dir(patches_root, version) / "pin.toml"), cache=cache,
                        downloader=pip_url_download_sdist)  # read, not built: no build requirements
    sources = read_sources(sdist, lambda rel: rel in ("pyproject.toml", ".pre-commit-config.yaml"))
    for name in ("pyproject.toml", ".pre-commit-config.yaml"):
        if name not in sources:
            raise PatchLintError(f"{sdist.name}: has no {name}")
    ruff = ensure_ruff(ruff_version(sources[".pre-commit-config.yaml"], f"{sdist.name}/.pre-commit-config.yaml"),
                       cache)
    base = base_tree(patches_root, version, cache=cache)
    with scratch("overlay-patch-lint-") as tmp:
        repo = Path(tmp)
        owners = _commit_series(repo, series, base)
        (repo / "pyproject.toml").write_text(sources["pyproject.toml"])
        files = sorted({p for patch in series.patches for p in patch.touched
                        if p.endswith(".py") and (repo / p).is_file()})
        return lint_tree(repo, owners, files, ruff)


def main(patches_root: Path, version: str) -> int:
    findings = run(patches_root, version)
    for f in findings:
        print(f)
    per_patch: dict[str, int] = {}
    for f in findings:
        per_patch[f.patch] = per_patch.get(f.patch, 0) + 1
    summary = ", ".join(f"{n} in {p}" for p, n in sorted(per_patch.items()))
    print(f"patch-lint {version}: " + (f"{len(findings)} finding(s): {summary}" if findings else
                                       "the lines the series adds pass the release's ruff check and ruff format"))
    return 1 if findings else 0
