"""Each release's whole resolved dependency set, for that release's test runs (``make rebase``,
``make rebase-continue``, ``make patch-tests-matrix``), whatever this environment holds.

A patch's tests on a tree of release ``X`` (the old base as much as the target) run in an
environment made of ``X``'s own dependencies alone: the tree, then ``<cache>/deps/<X>-<key>/``,
then this environment's CPU torch (nothing else of ``.venv``: the run's Python starts with ``-S``,
:func:`run_path`). That folder holds what pip resolves for the wheel's ``Requires-Dist`` (this
machine's markers, **extras kept**: ``fastapi[standard]`` brings ``uvicorn[standard]`` and so
``uvloop``, which vLLM imports), transitively, plus the test runner (:data:`RUNNER`), installed once
with ``pip install --no-deps --target`` of exactly the resolved versions; ``.complete`` lists them.

Before, the folder held only what the release pinned beyond ``.venv``: on a machine where ``make
build`` had filled ``.venv`` the runs worked, on a fresh clone (``make rebase`` installs the tool
only) the old base's tests stopped at ``No module named 'uvloop'`` and two patches were set aside as
conflicts. A verdict now depends on the release and the key, not on what happened to be installed.

Torch is the release's own: a release that pins exactly the torch this environment has runs on it
(the resolution sees a stand-in wheel of torch that requires what this torch requires, so torch's own
dependencies are in the set and nothing is installed twice); a release that pins another torch gets
that torch resolved and installed into its folder with the rest (production's release pins torch
2.13.0, which this machine's pip takes from its CPU build on disk; elsewhere PyPI's build, a CUDA one,
which runs on the CPU too), and the run then puts no torch of this environment on its path.
torchvision, torchaudio and torchcodec are never installed (vLLM's modules import without them, and
PyPI's CUDA builds of them break ``import vllm`` beside a CPU torch). The key is the wheel, Python,
the machine, the torch the run gets and the runner: the same key is the same environment on every
clone.

A release may pin a version the index does not serve (0.34.0: ``flashinfer-python==0.7.3``, which
PyPI never had; it has 0.7.2.post1 and 0.7.4): ``overlay/build/stand_ins.py`` names the version resolved in
its place, with the evidence, and the run says so. An exact pin the index lacks and the table does not
name is one line naming the requirement and that table.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from overlay import digest, lock
from overlay.atomic import child_tmpdir, scratch, temp_dir
from overlay.build.fetch import cache_dir
from overlay.build.install import CPU_SKIP, requirements, torch_pin
from overlay.build.pipeline import VERSION_PY
from overlay.build.stand_ins import TABLE, exact_pin, stand_in_version, swap_all
from overlay.errors import OverlayError
from overlay.interrupt import bound_to_parent

FAMILY = CPU_SKIP | {"torch"}  # torch: this environment's, or the release's own in its folder; the rest stay out
OWN_TORCH = "torch"  # the folder's own torch package: present, the run takes it instead of this environment's
RUNNER = ("pytest==9.2.0", "pytest-timeout==2.4.0")  # pyproject's test pins (held there by a test)
SCHEME = "whole-closure-1"  # how a folder is made: a new scheme is a new key
_VERSION = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)
DONE = ".complete"
MAKE_LOCK = ".making.lock"  # in <cache>/deps/: one maker at a time (each one pip install of gigabytes)


Resolver = Callable[[list[str]], list[str]]
"""``resolve(requirements)``: every distribution pip would install for them (``name==version``),
torch family left out, sorted."""
Installer = Callable[[list[str], Path], None]
"""``install(pins, dest)`` puts exactly those distributions (no dependencies) into the folder ``dest``."""


class DepsError(OverlayError):
    """A release's test environment could not be resolved or installed."""


def tree_version(tree: Path) -> str | None:
    """The vLLM release a text tree holds (``vllm/_version.py``), or None when it does not say."""
    try:
        found = _VERSION.search((tree / VERSION_PY).read_text(encoding="utf-8"))
    except OSError:
        return None
    return found[1] if found else None


@dataclass(frozen=True)
class Torch:
    """This environment's torch build, which every release's tests run on."""

    version: str
    requires: tuple[str, ...]  # its Requires-Dist as written (markers kept)
    entries: tuple[Path, ...]  # its top-level entries in site-packages (packages, the dist-info)


def env_torch() -> Torch:
    """The torch installed here; :class:`DepsError` when there is none."""
    try:
        dist = distribution("torch")
    except PackageNotFoundError:
        raise DepsError("this environment has no torch, the CPU build every release's tests run on: "
                        "install it (`make` does: pip install torch==2.13.0) and run again") from None
    base = Path(str(dist.locate_file("")))
    tops = sorted({f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "__pycache__")})
    entries = tuple(base / t for t in tops if (base / t).exists() and not t.endswith(".pth"))
    return Torch(dist.version, tuple(dist.requires or ()), entries)


def own_torch(wheel: Path, torch: Torch) -> str | None:
    """The torch the release pins exactly (:func:`overlay.build.install.torch_pin`) when it is not this
    environment's (its folder then holds it), else None (the run takes this environment's torch)."""
    pinned = torch_pin(wheel)
    return pinned if pinned is not None and Version(pinned).public != Version(torch.version).public else None


def roots(wheel: Path, torch: Torch) -> tuple[list[str], dict[str, tuple[str, tuple[str, ...]]]]:
    """What the resolution starts from: the wheel's requirements for this machine less the torch
    family (an exact pin ``overlay/build/stand_ins.py`` names at its stand-in version), plus :data:`RUNNER`
    (and ``torch==X`` when the release pins a torch this environment lacks: :func:`own_torch`);
    and the stand-ins of the family, ``name -> (version, requires)`` (torch when it is this environment's,
    at its version; the others the release pins exactly, requiring nothing)."""
    keep: list[str] = []
    stubs: dict[str, tuple[str, tuple[str, ...]]] = {}
    own = own_torch(wheel, torch)
    for text in requirements(wheel, skip=frozenset()):
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name not in FAMILY:
            keep.append(stand_in_version(req))
        elif name == "torch" and own is not None:
            keep.append(f"torch=={own}")
        elif (pinned := exact_pin(req)) is not None:
            stubs[name] = (pinned, torch.requires if name == "torch" else ())
    if "torch" not in stubs and own is None:
        stubs["torch"] = (Version(torch.version).public, torch.requires)
    return sorted(set(keep)) + list(RUNNER), stubs


def stub_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...]) -> Path:
    """A wheel of ``name`` ``version`` that holds nothing but its metadata (a stand-in for pip's resolver)."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)])
    files = {f"{dist}.dist-info/METADATA": meta,
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: vllm-overlay\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n",
             f"{dist}.dist-info/RECORD": ""}
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            zf.writestr(member, text)
    return path


_NO_SUCH_PIN = re.compile(r"No matching distribution found for ([A-Za-z0-9._-]+)==(\S+)")


def _pip(args: list[str], what: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    with child_tmpdir() as env:  # a killed install's pip-* temporaries go with the next run's sweep
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env,
                              preexec_fn=bound_to_parent())
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.strip().splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        last = (errors or lines or [f"exit {proc.returncode}"])[-1]
        raise DepsError(f"pip could not {what}: {last}{_unserved_pin(last)}")


def _unserved_pin(line: str) -> str:
    """What to do when the release pins a version the index does not serve (``line``: pip's error)."""
    found = _NO_SUCH_PIN.search(line)
    if found is None:
        return ""
    return (f" (the release pins {found[1]}=={found[2]}, which the index does not serve: name the version to "
            f"resolve in its place, with the evidence, in {TABLE})")


def pip_resolve(reqs: list[str]) -> list[str]:
    """:data:`Resolver` by ``pip install --dry-run --ignore-installed --report`` (nothing installed)."""
    with scratch("overlay-deps-") as tmp:
        report = Path(tmp) / "report.json"
        _pip(["install", "-q", "--dry-run", "--ignore-installed", "--prefer-binary", "--disable-pip-version-check",
              "--report", str(report), *reqs], f"resolve the test environment ({len(reqs)} requirements)")
        items = json.loads(report.read_text(encoding="utf-8")).get("install") or []
    keep_torch = any(canonicalize_name(Requirement(r).name) == "torch" and " @ " not in r for r in reqs)
    pins = {f"{canonicalize_name(i['metadata']['name'])}=={i['metadata']['version']}" for i in items
            if canonicalize_name(i["metadata"]["name"]) not in FAMILY
            or (keep_torch and canonicalize_name(i["metadata"]["name"]) == "torch")}
    return sorted(pins)


def pip_target(pins: list[str], dest: Path) -> None:
    """:data:`Installer`: ``pip install --no-deps --target dest`` of exactly ``pins``."""
    _pip(["install", "-q", "--disable-pip-version-check", "--no-deps", "--prefer-binary", "--no-warn-script-location",
          "--target", str(dest), *pins], f"install the test environment into {dest}")


def key_of(wheel: Path, torch: Torch, reqs: list[str], stubs: dict[str, tuple[str, tuple[str, ...]]]) -> str:
    """What makes a release's environment: its wheel, Python, the machine, the torch its runs get (this
    environment's, unless ``reqs`` name the release's own), the runner."""
    env = (torch.version, *torch.requires) if "torch" in stubs else ()
    parts = [SCHEME, wheel.name, sys.version, platform.machine(), *env, *reqs,
             *(f"{n}=={v}" for n, (v, _) in sorted(stubs.items()))]
    return digest.of_text("\n".join(parts))[:12]


def release_deps(release: str, wheel: Path, *, cache: Path | None = None, resolver: Resolver | None = None,
                 installer: Installer | None = None, torch: Torch | None = None) -> Path:
    """The folder of release ``release``'s whole dependency set (``wheel``'s), made once per key."""
    torch = torch or env_torch()
    reqs, stubs = roots(wheel, torch)
    root = (cache or cache_dir()) / "deps"
    dest = root / f"{release}-{key_of(wheel, torch, reqs, stubs)}"
    if (dest / DONE).is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    # One maker per folder: two test workers (or two commands) asking at once would each install it, and the
    # second's replace would pull the folder from under the first's runs.
    with lock.held(root / MAKE_LOCK, f"another run making a release's test environment in {root}"):
        if not (dest / DONE).is_file():
            own = None if "torch" in stubs else own_torch(wheel, torch)  # roots() stubbed torch unless it is
            _make(release, wheel, f"its own {own}" if own else f"this environment's {torch.version}", reqs, stubs,
                  root, dest, resolver, installer)
    return dest


def _make(release: str, wheel: Path, which: str, reqs: list[str], stubs: dict[str, tuple[str, tuple[str, ...]]],
          root: Path, dest: Path, resolver: Resolver | None, installer: Installer | None) -> None:
    print(f"deps {release}: resolving its whole dependency set for the test runs (torch: {which}) into {dest} ...",
          file=sys.stderr, flush=True)
    for line in swap_all(requirements(wheel, skip=frozenset()))[1]:
        print(f"deps {release}: {line}", file=sys.stderr, flush=True)
    with temp_dir(root, ".install-", legacy=(f".{dest.name}-",)) as tmp:  # a killed run's is removed by the next
        if resolver is None:
            stub_dir = tmp / ".stubs"
            stub_dir.mkdir()
            named = [f"{n} @ {stub_wheel(stub_dir, n, v, r).as_uri()}" for n, (v, r) in sorted(stubs.items())]
            pins = pip_resolve(reqs + named)
            shutil.rmtree(stub_dir)
        else:
            pins = resolver(reqs)
        print(f"deps {release}: installing {len(pins)} distributions", file=sys.stderr, flush=True)
        (installer or pip_target)(pins, tmp)
        (tmp / DONE).write_text("\n".join(pins) + "\n", encoding="utf-8")
        if dest.exists():
            shutil.rmtree(dest)  # an earlier attempt that did not complete
        os.replace(tmp, dest)


def deps_for(wheels: dict[str, Path]) -> Callable[[str], Path | None]:
    """``deps(release)`` for a test runner: :func:`release_deps` of ``wheels[release]``, made once per
    release and only when a run needs it; None for a release not in ``wheels``."""
    made: dict[str, Path] = {}

    def deps(release: str) -> Path | None:
        if release not in wheels:
            return None
        if release not in made:
            made[release] = release_deps(release, wheels[release])
        return made[release]

    return deps


def run_path(deps: Path, scratch: Path, torch: Torch | None = None) -> list[Path]:
    """What a test run of a tree puts after the tree on ``sys.path`` (its Python started with ``-S``,
    so nothing else of this environment): ``deps``, then, unless ``deps`` holds the release's own torch,
    a folder in ``scratch`` of links to this environment's torch."""
    if (deps / OWN_TORCH).is_dir():
        return [deps]
    torch = torch or env_torch()
    view = scratch / "torch"
    view.mkdir(parents=True, exist_ok=True)
    for entry in torch.entries:
        link = view / entry.name
        if not link.exists():
            link.symlink_to(entry, target_is_directory=entry.is_dir())
    return [deps, view]


def environment_of(deps: Path, torch: Torch | None = None) -> str:
    """The run environment of ``deps`` as one digest (its resolved set, this torch, Python), for the
    test runs kept (:mod:`overlay.maintain.rebase.runcache`)."""
    try:
        pins = (deps / DONE).read_text(encoding="utf-8")
    except OSError:
        pins = ""
    version = "own" if (deps / OWN_TORCH).is_dir() else (torch or env_torch()).version
    return digest.of_text("\n".join([sys.version, deps.name, pins, f"torch=={version}"]))
