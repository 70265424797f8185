"""The kernel stage's external sources, offline: what each FetchContent source is pinned to, which of
them the chosen targets compile from, and the ``kernel-sources`` folder that holds them.

vLLM's configure fetches its external projects (CUTLASS, FlashMLA, DeepGEMM, ...) from GitHub unless
an environment variable (``VLLM_CUTLASS_SRC_DIR``, ``FLASH_MLA_SRC_DIR``, ...) names a local tree.
Everything here is read from the release's own CMake files, never from a hand list:

- :func:`read_externals`: each ``FetchContent_Declare`` / ``FetchContent_Populate`` with a
  ``GIT_REPOSITORY`` on a CUDA build: its name, repository, pinned tag or commit, the variable that
  names a local tree, and the paths under its ``<name>_SOURCE_DIR`` that configure itself reads;
- :func:`compiled_from`: for each extension target, the externals its definition compiles from (its
  arguments name ``${<name>_SOURCE_DIR}``, a variable set from it, or a variable no vLLM file sets
  that the external's own CMake defines, such as CUTLASS's ``CUTLASS_INCLUDE_DIR``; the target is
  defined in the external's own file);
- :func:`plan`: for a set of targets, each external is *real* (a checkout at its pin) or a
  *placeholder* (the files configure reads, empty, and a ``PLACEHOLDER`` note): with placeholders
  for the externals a target does not compile from, its build commands are those of a configure
  with every real checkout. With no targets named, every external is real.

The folder (``kernel-sources/<version>/<name>/``) is filled from the pinned repositories or a
mirror (:func:`fill`), checked against the pins before every build (:func:`verify`), and staged at
fixed paths for the build (:func:`stage`), which then runs with ``FETCHCONTENT_FULLY_DISCONNECTED``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from overlay.atomic import temp_dir
from overlay.errors import OverlayError
from overlay.kernels.targets import commands, eval_condition

PLACEHOLDER = "PLACEHOLDER"
MANIFEST = "SOURCES.json"
_HEX = re.compile(r"[0-9a-f]{40}")


class KernelSourcesError(OverlayError):
    """The kernel sources are missing, at the wrong commit, or cannot be read from the CMake files."""


@dataclass
class External:
    """One FetchContent source of the release."""

    name: str  # FetchContent name (``cutlass``, ``vllm-flash-attn``)
    repository: str
    tag: str  # a 40-hex commit or a tag name
    env: str  # the variable naming a local tree (``VLLM_CUTLASS_SRC_DIR``)
    cmake_file: str
    reads: set[str] = field(default_factory=set)  # files under <name>_SOURCE_DIR configure names
    dirs: set[str] = field(default_factory=set)  # folders under it configure names

    @property
    def source_var(self) -> str:
        return f"{self.name.lower()}_SOURCE_DIR"

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "repository": self.repository, "tag": self.tag, "env": self.env,
                "cmake_file": self.cmake_file}


@dataclass
class _Walk:
    files: Mapping[str, str]
    values: dict[str, str] = field(default_factory=dict)
    externals: dict[str, External] = field(default_factory=dict)
    available: list[str] = field(default_factory=list)  # externals made available so far, in order
    targets: dict[str, tuple[str, list[str], tuple[str, ...]]] = field(default_factory=dict)
    # target -> (file, raw args, externals available at its definition)


_REF = re.compile(r"\$\{([\w-]+)\}")


def _expand(text: str, values: Mapping[str, str], depth: int = 0) -> str:
    if depth > 20:
        return text
    return _REF.sub(lambda m: _expand(values[m[1]], values, depth + 1) if m[1] in values else m[0], text)


def _keyword_value(args: list[str], keyword: str) -> str | None:
    for i, a in enumerate(args[:-1]):
        if a == keyword:
            return args[i + 1].strip('"')
    return None


def _env_before(text: str, pos: int) -> str:
    found = re.findall(r"ENV\{(\w+_SRC_DIR)\}", text[:pos])
    return found[-1] if found else ""


def _walk_file(w: _Walk, path: str, seen: tuple[str, ...]) -> None:
    text = w.files[path]
    frames: list[tuple[bool, bool]] = []
    offsets = [m.start() for m in re.finditer(r"(?i)fetchcontent_(?:declare|populate)\s*\(", text)]
    fc_index = 0
    for name, args in commands(text):
        if name == "if":
            v = eval_condition(args)
            frames.append((v is not False, v is True))
            continue
        if name == "elseif" and frames:
            v = eval_condition(args)
            _, taken = frames[-1]
            frames[-1] = (not taken and v is not False, taken or v is True)
            continue
        if name == "else" and frames:
            _, taken = frames[-1]
            frames[-1] = (not taken, True)
            continue
        if name == "endif" and frames:
            frames.pop()
            continue
        is_fc = name in ("fetchcontent_declare", "fetchcontent_populate")
        pos = offsets[fc_index] if is_fc and fc_index < len(offsets) else len(text)
        fc_index += is_fc
        if not all(f[0] for f in frames):
            continue
        if name == "set" and args and "CACHE" not in args:
            w.values[args[0]] = ";".join(a.strip('"') for a in args[1:])
        elif is_fc and args:
            ext_name = args[0].strip('"')
            repo = _keyword_value(args, "GIT_REPOSITORY")
            if repo:
                tag = _expand(_keyword_value(args, "GIT_TAG") or "", w.values)
                w.externals[ext_name] = External(ext_name, _expand(repo, w.values), tag,
                                                 _env_before(text, pos), path)
            if name == "fetchcontent_populate" and ext_name not in w.available:
                w.available.append(ext_name)
        elif name == "fetchcontent_makeavailable":
            w.available += [a for a in args if a not in w.available]
        elif name == "include" and args:
            inc = _expand(args[0].strip('"'), w.values).replace("${CMAKE_CURRENT_LIST_DIR}/", "")
            if inc in w.files and inc not in seen:
                _walk_file(w, inc, (*seen, inc))
        elif name == "define_extension_target" and args:
            w.targets[args[0].strip('"')] = (path, list(args[1:]), tuple(w.available))
        _note_reads(w, name, args)


def _note_reads(w: _Walk, command: str, args: list[str]) -> None:
    """Record every literal ``${<name>_SOURCE_DIR}/path`` a command names (what configure reads)."""
    for i, a in enumerate(args):
        for m in re.finditer(r"\$\{([\w-]+)_SOURCE_DIR\}(/[^\s;\"*?\[\]$]*)?", a.strip('"')):
            owner = m[1].lower()
            rel = (m[2] or "/").lstrip("/").rstrip("\\")
            ext = next((e for e in w.externals.values() if e.name.lower() == owner), None)
            if ext is None or not rel or "*" in a:
                continue
            as_dir = rel.endswith("/") or (command == "install" and i > 0 and args[i - 1] == "DIRECTORY") \
                or not Path(rel).suffix or command in ("include_directories", "target_include_directories") \
                or "INCLUDE" in " ".join(args[:i])
            (ext.dirs if as_dir else ext.reads).add(rel.rstrip("/"))


def _walk(files: Mapping[str, str]) -> _Walk:
    if "CMakeLists.txt" not in files:
        raise KernelSourcesError("source tree has no CMakeLists.txt: cannot tell which sources it fetches")
    w = _Walk(files)
    _walk_file(w, "CMakeLists.txt", ("CMakeLists.txt",))
    return w


def read_externals(files: Mapping[str, str]) -> dict[str, External]:
    """The release's FetchContent sources on a CUDA build, by name."""
    w = _walk(files)
    if not w.externals:
        raise KernelSourcesError("CMakeLists.txt and its cmake/ files declare no FetchContent source with a "
                                 "GIT_REPOSITORY: not a vLLM source tree?")
    return w.externals


def _references(arg: str, values: Mapping[str, str], depth: int = 0) -> set[str]:
    """Every variable an argument names, through the variables it was set from."""
    out: set[str] = set()
    for m in _REF.finditer(arg):
        out.add(m[1])
        if m[1] in values and depth < 20:
            out |= _references(values[m[1]], values, depth + 1)
    return out


def _prefix(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def compiled_from(files: Mapping[str, str]) -> dict[str, set[str]]:
    """For each extension target, the externals it compiles from."""
    w = _walk(files)
    out: dict[str, set[str]] = {}
    for target, (path, args, available) in w.targets.items():
        uses: set[str] = set()
        own = {e.name for e in w.externals.values() if e.cmake_file == path and path != "CMakeLists.txt"}
        uses |= own
        refs = set().union(*(_references(a, w.values) for a in args)) if args else set()
        for ref in refs:
            if ref.endswith("_SOURCE_DIR"):
                uses |= {e.name for e in w.externals.values() if e.source_var.lower() == ref.lower()}
            elif ref not in w.values and re.search(r"(DIR|INCLUDE|PATH)", ref):
                # A path set by no vLLM file: the CMake of an external made available before defines it
                # (CUTLASS_INCLUDE_DIR); by its name when one matches, else any of them.
                matches = {e for e in available if e in w.externals and _prefix(ref).startswith(_prefix(e))}
                uses |= matches or {e for e in available if e in w.externals}
        out[target] = uses
    return out


@dataclass(frozen=True)
class Decision:
    """One external in the plan: a real checkout, or a placeholder for configure."""

    external: External
    real: bool
    why: str


def plan(files: Mapping[str, str], targets: Sequence[str] = ()) -> list[Decision]:
    """Each external, real or placeholder, for building ``targets`` (every target: all real)."""
    externals = read_externals(files)
    if not targets:
        return [Decision(e, True, "every target is built") for e in externals.values()]
    uses = compiled_from(files)
    unknown = [t for t in targets if t not in uses]
    if unknown:
        raise KernelSourcesError(f"target {unknown[0]!r}: no define_extension_target of this release defines it "
                                 f"(targets: {', '.join(sorted(uses))})")
    out = []
    for e in externals.values():
        users = [t for t in targets if e.name in uses[t]]
        out.append(Decision(e, bool(users), f"compiled by {', '.join(users)}" if users
                            else f"read by configure only: {', '.join(targets)} "
                               f"{'compiles' if len(targets) == 1 else 'compile'} nothing from it"))
    return out


# ------------------------------------------------------------------------------- the folder

def _git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-c", "advice.detachedHead=false", *args], cwd=cwd, capture_output=True,
                          text=True, check=False, stdin=subprocess.DEVNULL)


def checkout_commit(path: Path) -> str | None:
    """The commit a checkout's HEAD is at (``None``: not a git checkout)."""
    proc = _git("rev-parse", "--verify", "HEAD^{commit}", cwd=path)
    return proc.stdout.strip() if proc.returncode == 0 else None


def _tag_commit(path: Path, tag: str) -> str | None:
    proc = _git("rev-parse", "--verify", "--quiet", f"refs/tags/{tag}^{{commit}}", cwd=path)
    return proc.stdout.strip() if proc.returncode == 0 else None


def verify_real(path: Path, ext: External) -> str:
    """The checkout's commit if it is the pin's and has no local change, else one line saying why not."""
    where = f"{path}"
    if not path.is_dir():
        raise KernelSourcesError(f"{where}: missing ({ext.name} is pinned to {ext.tag} in {ext.cmake_file}); "
                                 "run `make kernel-sources`")
    if (path / PLACEHOLDER).exists():
        raise KernelSourcesError(f"{where}: is a placeholder, but the targets compile from {ext.name}; "
                                 "run `make kernel-sources` without TARGETS or with these targets")
    head = checkout_commit(path)
    if head is None:
        raise KernelSourcesError(f"{where}: not a git checkout, so its commit cannot be checked against "
                                 f"{ext.name}'s pin {ext.tag} ({ext.cmake_file})")
    want = ext.tag if _HEX.fullmatch(ext.tag) else _tag_commit(path, ext.tag)
    if want is None:
        raise KernelSourcesError(f"{where}: has no tag {ext.tag!r} ({ext.name}'s pin in {ext.cmake_file}), so "
                                 f"HEAD {head[:12]} cannot be checked; fill it with `make kernel-sources`")
    if head != want:
        raise KernelSourcesError(f"{where}: HEAD is {head[:12]}, but {ext.cmake_file} pins {ext.name} to "
                                 f"{ext.tag} ({want[:12]})")
    dirty = _git("status", "--porcelain", "--untracked-files=no", cwd=path)
    if dirty.returncode != 0 or dirty.stdout.strip():
        first = (dirty.stdout.strip().splitlines() or [dirty.stderr.strip()])[0]
        raise KernelSourcesError(f"{where}: has local changes ({first.strip()}); a kernel build uses the "
                                 "pinned source as it is")
    return head


def _placeholder_note(ext: External, why: str) -> str:
    return (f"placeholder for {ext.name} ({ext.repository} at {ext.tag}), made by vllm-overlay: {why}.\n"
            "Only configure reads this folder; its own targets cannot be built from it.\n")


def make_placeholder(dest: Path, ext: External, why: str) -> None:
    """The files and folders configure reads from ``ext``, empty, and the ``PLACEHOLDER`` note."""
    dest.mkdir(parents=True)
    (dest / PLACEHOLDER).write_text(_placeholder_note(ext, why))
    for d in sorted(ext.dirs):
        (dest / d).mkdir(parents=True, exist_ok=True)
    for f in sorted(ext.reads):
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        (dest / f).touch()


def remote_for(ext: External, mirror: str | None) -> str:
    """The repository to fetch ``ext`` from: its pinned URL, or ``mirror`` with ``{owner}``, ``{repo}``,
    ``{name}`` filled in (``/srv/git/{owner}+{repo}`` or ``https://git.example/{repo}.git``)."""
    if not mirror:
        return ext.repository
    m = re.search(r"[:/]([^/:]+)/([^/]+?)(?:\.git)?/?$", ext.repository)
    owner, repo = (m[1], m[2]) if m else ("", ext.name)
    return mirror.format(owner=owner, repo=repo, name=ext.name)


def _check_remote(remote: str) -> None:
    if remote.startswith("-"):
        raise KernelSourcesError(f"remote {remote!r}: starts with '-' (would be read as a git option)")


def fetch_checkout(dest: Path, ext: External, remote: str, *, exclude: Sequence[str] = ()) -> str:
    """A checkout of ``ext``'s pin from ``remote`` at ``dest`` (made beside it, then moved into place).

    ``exclude``: paths left out of the checkout (a partial mirror that lacks their blobs); recorded by
    git's sparse checkout, so :func:`verify_real` still sees a clean tree at the pin."""
    _check_remote(remote)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with temp_dir(dest.parent, ".checkout-", legacy=(f".{dest.name}-",)) as work:  # a killed run's: swept
        local = Path(remote).is_dir()
        steps: list[list[str]] = []
        if local:  # a mirror on disk: share its objects, read only what the checkout needs
            steps.append(["clone", "--quiet", "--shared", "--no-checkout", "--", remote, str(work)])
        else:
            steps += [["init", "--quiet", str(work)], ["-C", str(work), "remote", "add", "origin", "--", remote]]
            ref = ext.tag if _HEX.fullmatch(ext.tag) else f"+refs/tags/{ext.tag}:refs/tags/{ext.tag}"
            steps.append(["-C", str(work), "fetch", "--quiet", "--depth", "1", "origin", "--", ref])
        for step in steps:
            proc = _git(*step)
            if proc.returncode != 0:
                raise KernelSourcesError(f"{ext.name}: git {step[0] if step[0] != '-C' else step[2]} from {remote} "
                                         f"failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        commit = ext.tag if _HEX.fullmatch(ext.tag) else _tag_commit(work, ext.tag)
        if commit is None:
            raise KernelSourcesError(f"{ext.name}: {remote} has no tag {ext.tag!r} (the pin in {ext.cmake_file})")
        if exclude:
            _git("-C", str(work), "config", "core.sparseCheckout", "true")
            (work / ".git" / "info").mkdir(parents=True, exist_ok=True)
            (work / ".git" / "info" / "sparse-checkout").write_text(
                "/*\n" + "".join(f"!/{p.lstrip('/')}\n" for p in exclude))
        proc = _git("-C", str(work), "checkout", "--quiet", "--detach", commit)
        if proc.returncode != 0:
            raise KernelSourcesError(f"{ext.name}: checkout of {commit[:12]} from {remote} failed: "
                                     f"{(proc.stderr.strip().splitlines() or ['?'])[-1]} (a partial mirror: "
                                     "leave the missing paths out with EXCLUDE=)")
        if local:
            _self_contained(work, commit, ext.tag)
        if dest.exists():
            shutil.rmtree(dest)
        work.rename(dest)
        return commit


def _self_contained(work: Path, commit: str, tag: str) -> None:
    """Make a ``--shared`` clone stand alone as a one-commit (shallow) checkout: pack the objects of
    ``commit``'s tree that are there, drop the mirror's refs and the link to its objects, keep the tag.
    The folder then verifies wherever it is copied (a build context, another machine)."""
    listed = _git("-C", str(work), "rev-list", "--objects", "--no-walk", "--missing=allow-any", commit)
    names = "".join(line.split(" ", 1)[0] + "\n" for line in listed.stdout.splitlines())
    packed = subprocess.run(["git", "-C", str(work), "pack-objects", "--quiet", ".git/objects/pack/pack"],
                            input=names, capture_output=True, text=True, check=False)
    if listed.returncode != 0 or packed.returncode != 0:
        raise KernelSourcesError(f"{work}: could not pack {commit[:12]}'s objects: "
                                 f"{(listed.stderr or packed.stderr).strip().splitlines()[-1:]}")
    refs = _git("-C", str(work), "for-each-ref", "--format=delete %(refname)")
    subprocess.run(["git", "-C", str(work), "update-ref", "--no-deref", "--stdin"], input=refs.stdout, text=True,
                   check=False)
    (work / ".git" / "objects" / "info" / "alternates").unlink(missing_ok=True)
    (work / ".git" / "shallow").write_text(commit + "\n")
    if not _HEX.fullmatch(tag):
        _git("-C", str(work), "tag", tag, commit)  # names the commit the mirror's tag named at fill time


@dataclass(frozen=True)
class Entry:
    """One source as the folder holds it."""

    name: str
    kind: str  # "real" or "placeholder"
    commit: str | None
    path: Path
    why: str


def fill(root: Path, decisions: Sequence[Decision], *, mirror: str | None = None,
         remotes: Mapping[str, str] | None = None, exclude: Mapping[str, Sequence[str]] | None = None,
         log: Callable[[str], object] = print) -> list[Entry]:
    """Make ``root`` hold each decision: a checkout at the pin (kept when it already verifies) or a
    placeholder (remade each time); write the manifest. ``remotes`` names a source's repository
    by external name, over ``mirror`` and the pinned URL."""
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for d in decisions:
        dest = root / d.external.name
        if d.real:
            try:
                commit = verify_real(dest, d.external)
                log(f"kernel-sources: {d.external.name}: checkout at {commit[:12]} ({d.external.tag}), kept")
            except KernelSourcesError:
                remote = (remotes or {}).get(d.external.name) or remote_for(d.external, mirror)
                log(f"kernel-sources: {d.external.name}: fetching {d.external.tag} from {remote} ...")
                commit = fetch_checkout(dest, d.external, remote, exclude=(exclude or {}).get(d.external.name, ()))
            entries.append(Entry(d.external.name, "real", commit, dest, d.why))
        else:
            tmp = root / f".{d.external.name}.placeholder"
            shutil.rmtree(tmp, ignore_errors=True)
            make_placeholder(tmp, d.external, d.why)
            if dest.exists():
                if not (dest / PLACEHOLDER).exists() and checkout_commit(dest) is not None:
                    shutil.rmtree(tmp)
                    log(f"kernel-sources: {d.external.name}: a checkout is there; kept (only configure reads it)")
                    entries.append(Entry(d.external.name, "real", checkout_commit(dest), dest, d.why))
                    continue
                shutil.rmtree(dest)
            tmp.rename(dest)
            log(f"kernel-sources: {d.external.name}: placeholder ({d.why})")
            entries.append(Entry(d.external.name, "placeholder", None, dest, d.why))
    write_manifest(root, decisions, entries)
    return entries


def write_manifest(root: Path, decisions: Sequence[Decision], entries: Sequence[Entry]) -> None:
    ext = {d.external.name: d.external for d in decisions}
    data = [{**ext[e.name].to_json(), "kind": e.kind, "commit": e.commit, "why": e.why} for e in entries]
    (root / MANIFEST).write_text(json.dumps(data, indent=2) + "\n")


def verify(root: Path, decisions: Sequence[Decision]) -> list[Entry]:
    """Check the folder against the plan: each real source a clean checkout at its pin (a checkout
    where a placeholder would do is fine), each other one present. One line for the first fault."""
    entries = []
    for d in decisions:
        dest = root / d.external.name
        if d.real:
            entries.append(Entry(d.external.name, "real", verify_real(dest, d.external), dest, d.why))
        elif not dest.is_dir() or not any(dest.iterdir()):
            raise KernelSourcesError(f"{dest}: missing (a placeholder for {d.external.name} would do); "
                                     "run `make kernel-sources`")
        elif (dest / PLACEHOLDER).exists():
            entries.append(Entry(d.external.name, "placeholder", None, dest, d.why))
        else:
            entries.append(Entry(d.external.name, "real", checkout_commit(dest), dest, d.why))
    return entries


def stage(entries: Sequence[Entry], dest: Path) -> dict[str, Path]:
    """Copy each source's files (not its ``.git``) to ``dest/<name>``, a fixed path the compile
    commands (and so ccache) see the same from any checkout; unchanged sources are not copied again."""
    dest.mkdir(parents=True, exist_ok=True)
    out = {}
    for e in entries:
        target = dest / e.name
        stamp = f"{e.kind} {e.commit or ''} {e.path.resolve()}\n"
        stamp_file = dest / f".{e.name}.staged"
        if not (target.is_dir() and stamp_file.is_file() and stamp_file.read_text() == stamp and e.kind == "real"):
            tmp = dest / f".{e.name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(e.path, tmp, symlinks=True, ignore=shutil.ignore_patterns(".git"))
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
            stamp_file.write_text(stamp)
        out[e.name] = target
    return out


def env_lines(decisions: Sequence[Decision], staged: Mapping[str, Path]) -> list[str]:
    """``NAME=path`` lines for the build script: each external's local-tree variable."""
    return [f"{d.external.env}={staged[d.external.name]}" for d in decisions if d.external.env]


def read_cmake_files(tree: Path) -> dict[str, str]:
    """``CMakeLists.txt`` and ``cmake/**/*.cmake`` of an unpacked source tree."""
    files = {}
    for p in [tree / "CMakeLists.txt", *sorted((tree / "cmake").rglob("*.cmake"))]:
        if p.is_file():
            files[p.relative_to(tree).as_posix()] = p.read_text(errors="replace")
    return files

