"""Kernels: which CUDA extension targets compile a touched source, and the rebuilt binaries as build inputs.

Which targets a source belongs to is read from the release's own ``CMakeLists.txt`` (and the
``cmake/`` files it includes): ``define_extension_target(NAME ... SOURCES ...)`` with the ``set`` /
``list(APPEND)`` variables expanded in order, branches that cannot be taken on a CUDA build skipped.
A touched source that no target lists (a header) rebuilds every in-tree target; a touched build
file (``CMakeLists.txt``, ``cmake/``) rebuilds every target. ``make image``'s kernel stage rebuilds
them; :func:`collect_kernels` hands the binaries to the overlay build.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from overlay.errors import OverlayError


class KernelMapError(OverlayError):
    """The release's CMake files do not say which targets compile a touched source."""


def _is_build_file(path: str) -> bool:
    return path == "CMakeLists.txt" or path.startswith("cmake/")


def is_cmake_source(path: str) -> bool:
    """The sdist members the target map is read from."""
    return path == "CMakeLists.txt" or (path.startswith("cmake/") and path.endswith(".cmake"))


def _strip_comments(text: str) -> str:
    out: list[str] = []
    for line in text.splitlines():
        in_quote = False
        for i, ch in enumerate(line):
            if ch == '"' and (i == 0 or line[i - 1] != "\\"):
                in_quote = not in_quote
            elif ch == "#" and not in_quote:
                line = line[:i]
                break
        out.append(line)
    return "\n".join(out)


_CMD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(")
_ARG = re.compile(r'"(?:[^"\\]|\\.)*"|[^\s()"]+(?:"(?:[^"\\]|\\.)*")?|[()]')


def commands(text: str) -> list[tuple[str, list[str]]]:
    """``(name, args)`` of every command call, args split as CMake does (quotes kept)."""
    text = _strip_comments(text)
    out: list[tuple[str, list[str]]] = []
    pos = 0
    while True:
        m = _CMD.search(text, pos)
        if not m:
            return out
        depth, i, in_quote = 1, m.end(), False
        while i < len(text) and depth:
            ch = text[i]
            if ch == '"' and text[i - 1] != "\\":
                in_quote = not in_quote
            elif not in_quote:
                depth += ch == "("
                depth -= ch == ")"
            i += 1
        body = text[m.end(): i - 1]
        out.append((m[1].lower(), _ARG.findall(body)))
        pos = i


# Facts of the build the image runs: CUDA, not HIP or CPU.
_FACTS = {"VLLM_GPU_LANG": "CUDA", "VLLM_TARGET_DEVICE": "cuda"}


def eval_condition(args: list[str]) -> bool | None:
    """Three-valued: ``False`` only when the condition is false on a CUDA build, else unknown/true."""
    tokens = [a.strip('"') if not a.startswith("${") else a for a in args]
    tokens = [re.sub(r"^\$\{(\w+)\}$", r"\1", t) for t in tokens]

    def atom(i: int) -> tuple[bool | None, int]:
        if i >= len(tokens):
            return None, i
        t = tokens[i]
        if t == "NOT":
            v, j = atom(i + 1)
            return (None if v is None else not v), j
        if t == "(":
            v, j = disj(i + 1)
            return v, j + 1  # skip ")"
        if i + 2 < len(tokens) and tokens[i + 1] == "STREQUAL":
            left, right = tokens[i], tokens[i + 2]
            return (_FACTS[left] == right if left in _FACTS else None), i + 3
        # Any other predicate (VERSION_GREATER, DEFINED, a plain variable): unknown, consume one
        # operator and operand if present.
        j = i + 1
        if j < len(tokens) and tokens[j].isupper() and tokens[j] not in ("AND", "OR") and j + 1 < len(tokens):
            j += 2
        return None, j

    def conj(i: int) -> tuple[bool | None, int]:
        v, i = atom(i)
        while i < len(tokens) and tokens[i] == "AND":
            w, i = atom(i + 1)
            v = False if (v is False or w is False) else (True if (v and w) else None)
        return v, i

    def disj(i: int) -> tuple[bool | None, int]:
        v, i = conj(i)
        while i < len(tokens) and tokens[i] == "OR":
            w, i = conj(i + 1)
            v = True if (v is True or w is True) else (False if (v is False and w is False) else None)
        return v, i

    return disj(0)[0]


@dataclass
class KernelMap:
    """What a CUDA build of the release defines: targets and the literal sources each compiles."""

    sources: dict[str, set[str]] = field(default_factory=dict)  # target -> csrc/... paths
    globs: dict[str, set[str]] = field(default_factory=dict)  # target -> csrc/ glob patterns
    destinations: dict[str, str] = field(default_factory=dict)  # target -> install folder

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(sorted(self.sources))

    @property
    def in_tree(self) -> tuple[str, ...]:
        """Targets that compile sources of the release's own ``csrc/``."""
        return tuple(sorted(t for t in self.sources if self.sources[t] or self.globs[t]))

    def owners(self, path: str) -> tuple[str, ...]:
        return tuple(sorted(
            t for t in self.sources
            if path in self.sources[t] or any(fnmatch.fnmatchcase(path, g) for g in self.globs[t])
        ))


_KEYWORDS = {"DESTINATION", "LANGUAGE", "SOURCES", "COMPILE_FLAGS", "ARCHITECTURES",
             "INCLUDE_DIRECTORIES", "LIBRARIES", "USE_SABI", "WITH_SOABI"}


def read_kernel_map(files: Mapping[str, str]) -> KernelMap:
    """Walk ``CMakeLists.txt`` (following ``include()`` of files in ``files``) the way a CUDA build does."""
    if "CMakeLists.txt" not in files:
        raise KernelMapError("source tree has no CMakeLists.txt: cannot tell which targets compile what")
    kmap = KernelMap()
    values: dict[str, list[str]] = {}
    # Each frame: (this branch may run, some earlier branch of this if() surely ran)
    frames: list[tuple[bool, bool]] = []

    def live() -> bool:
        return all(f[0] for f in frames)

    def expand(token: str, depth: int = 0) -> list[str]:
        t = token.strip('"')
        out: list[str] = []
        for part in t.split(";"):
            m = re.fullmatch(r"\$\{(\w+)\}", part)
            if m:
                if depth < 20:
                    out += [p for v in values.get(m[1], []) for p in expand(v, depth + 1)]
                continue
            part = re.sub(r"^\$\{CMAKE_CURRENT_(?:SOURCE|LIST)_DIR\}/", "", part)
            if part and "${" not in part:
                out.append(part)
        return out

    def walk(text: str, seen: tuple[str, ...]) -> None:
        for name, args in commands(text):
            if name == "if":
                v = eval_condition(args)
                frames.append((v is not False, v is True))
            elif name == "elseif" and frames:
                v = eval_condition(args)
                _, taken = frames[-1]
                frames[-1] = (not taken and v is not False, taken or v is True)
            elif name == "else" and frames:
                _, taken = frames[-1]
                frames[-1] = (not taken, True)
            elif name == "endif" and frames:
                frames.pop()
            elif not live():
                continue
            elif name == "set" and args and "CACHE" not in args:
                values[args[0]] = [v for a in args[1:] for v in expand(a)]
            elif name == "list" and len(args) >= 2 and args[0] == "APPEND":
                values.setdefault(args[1], []).extend(v for a in args[2:] for v in expand(a))
            elif name == "file" and len(args) >= 3 and args[0] in ("GLOB", "GLOB_RECURSE"):
                pats = [p for a in args[2:] if a != "CONFIGURE_DEPENDS" for p in expand(a)]
                values[args[1]] = [f"glob:{p}" for p in pats]
            elif name == "include" and args:
                inc = expand(args[0])
                if inc and inc[0] in files and inc[0] not in seen:
                    walk(files[inc[0]], (*seen, inc[0]))
            elif name == "define_extension_target" and args:
                target = args[0].strip('"')
                srcs: list[str] = []
                keyword = ""
                for a in args[1:]:
                    if a in _KEYWORDS:
                        keyword = a
                    elif keyword == "SOURCES":
                        srcs += expand(a)
                    elif keyword == "DESTINATION":
                        kmap.destinations[target] = a.strip('"')
                kmap.sources.setdefault(target, set())
                kmap.globs.setdefault(target, set())
                for s in srcs:
                    if s.startswith("glob:csrc/"):
                        kmap.globs[target].add(s[len("glob:"):])
                    elif s.startswith("csrc/"):
                        kmap.sources[target].add(s)

    walk(files["CMakeLists.txt"], ("CMakeLists.txt",))
    return kmap


@dataclass(frozen=True)
class KernelTargets:
    """The extension targets the kernel stage builds, and why each touched path is there."""

    targets: tuple[str, ...]
    reasons: tuple[tuple[str, tuple[str, ...], str], ...]  # (path, targets, why)
    destinations: tuple[tuple[str, str], ...] = ()  # (target, install folder)

    def outputs(self) -> tuple[str, ...]:
        """The wheel members the targets install (``DESTINATION/NAME.abi3.so``)."""
        dest = dict(self.destinations)
        return tuple(f"{dest.get(t, 'vllm')}/{t}.abi3.so" for t in self.targets)


def resolve_targets(touched: tuple[str, ...], kmap: KernelMap) -> KernelTargets:
    """Map the kernel paths a series touches to the targets to rebuild."""
    from overlay.build.series import is_kernel_path

    chosen: set[str] = set()
    reasons: list[tuple[str, tuple[str, ...], str]] = []
    for path in touched:
        if not is_kernel_path(path):
            continue
        if _is_build_file(path):
            ts, why = kmap.targets, "build file: every target"
        else:
            owners = kmap.owners(path)
            if owners:
                ts, why = owners, "listed in its SOURCES"
            else:
                ts, why = kmap.in_tree, "listed by no target (header?): every in-tree target"
        if not ts:
            raise KernelMapError(f"{path}: no CUDA extension target of this release compiles it")
        chosen.update(ts)
        reasons.append((path, ts, why))
    return KernelTargets(
        tuple(sorted(chosen)), tuple(reasons),
        tuple(sorted((t, kmap.destinations.get(t, "vllm")) for t in chosen)),
    )

def collect_kernels(directory: Path) -> dict[str, Path]:
    """Map archive paths (``vllm/_C.abi3.so``) to the rebuilt files under ``directory``."""
    if not directory.is_dir():
        raise OverlayError(f"{directory}: kernel folder does not exist")
    found = {
        p.relative_to(directory).as_posix(): p
        for p in sorted(directory.rglob("*.so"))
        if p.is_file()
    }
    if not found:
        raise OverlayError(f"{directory}: holds no .so files")
    bad = [k for k in found if not k.startswith("vllm/")]
    if bad:
        raise OverlayError(f"{directory}: {bad[0]!r} is not under vllm/ (lay files out as in the wheel)")
    return found
