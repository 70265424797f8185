"""The dependencies a release pins that this environment does not satisfy, installed beside it for
that release's test runs (``make rebase``, ``make patch-tests-matrix``).

The environment is built for the default release (``make build``). A later release may import a
newer dependency than it has: vLLM 0.32.0 imports ``humming.tune.process_input``, which
``humming-kernels`` 0.1.12 (0.28.0's pin) lacks, so its model runner does not even import. For a
tree of such a release the runs put ``<cache>/deps/<version>-<key>/`` after the tree on
``sys.path``: the release's own ``Requires-Dist`` that this environment does not satisfy, installed
there with ``pip install --no-deps --target`` once (small: 45 MB for 0.32.0), and then what those
packages require that neither the folder nor the environment satisfies, round by round until
nothing is missing (0.31.0 pins ``transformers<5.18``; 5.17 requires ``huggingface-hub<2``, and the
environment has 2.4). The torch family is left to the environment's CPU build (PyPI's builds are
CUDA ones that do not import beside it): 0.33.0 pins torch 2.14.0 and runs on 2.13.0 here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, distributions, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from overlay import digest
from overlay.build.fetch import cache_dir
from overlay.build.install import CPU_SKIP, requirements
from overlay.build.pipeline import VERSION_PY
from overlay.errors import OverlayError

ENV_SERVES = CPU_SKIP | {"torch"}  # the environment's own CPU torch serves every release
_VERSION = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)
DONE = ".complete"
ROUNDS = 8  # dependency rounds before the closure is called runaway

Installer = Callable[[list[str], Path], None]
"""``install(requirements, dest)`` puts those packages (no dependencies) into the folder ``dest``."""


def tree_version(tree: Path) -> str | None:
    """The vLLM release a text tree holds (``vllm/_version.py``), or None when it does not say."""
    try:
        found = _VERSION.search((tree / VERSION_PY).read_text(encoding="utf-8"))
    except OSError:
        return None
    return found[1] if found else None


def unmet(wheel: Path) -> list[str]:
    """The wheel's requirements (markers of this machine, extras dropped, the torch family left out)
    that the packages installed here do not satisfy, sorted."""
    reqs = [Requirement(text) for text in requirements(wheel)]
    return sorted(f"{r.name}{r.specifier}" for r in reqs
                  if canonicalize_name(r.name) not in ENV_SERVES and not _satisfied(r, {}))


def _satisfied(req: Requirement, first: dict[str, str]) -> bool:
    """Whether the version in ``first`` (canonical name -> version), else the one installed here,
    meets ``req``."""
    have = first.get(canonicalize_name(req.name))
    if have is None:
        try:
            have = version(req.name)
        except PackageNotFoundError:
            return False
    return req.specifier.contains(have, prereleases=True)


def _in_folder(folder: Path) -> dict[str, str]:
    """Canonical name -> version of the distributions installed in ``folder``."""
    return {canonicalize_name(d.metadata["Name"]): d.version for d in distributions(path=[str(folder)])}


def unmet_in(folder: Path, asked: set[str]) -> list[str]:
    """What the distributions in ``folder`` require (markers of this machine, no extras) that
    neither ``folder`` nor this environment satisfies, leaving out the torch family and the names
    in ``asked`` (already installed there), sorted."""
    have_here = _in_folder(folder)
    out: set[str] = set()
    for dist in distributions(path=[str(folder)]):
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = canonicalize_name(req.name)
            if name not in ENV_SERVES and name not in asked and not _satisfied(req, have_here):
                out.add(f"{req.name}{req.specifier}")
    return sorted(out)


def install_closure(reqs: list[str], dest: Path, installer: Installer) -> list[str]:
    """Install ``reqs`` into ``dest``, then what they need beyond ``dest`` and this environment,
    round by round; every requirement installed, in order."""
    done: list[str] = []
    asked: set[str] = set()
    for _ in range(ROUNDS):
        if not reqs:
            return done
        if done:
            print(f"deps: and what those require beyond this environment: {', '.join(reqs)}",
                  file=sys.stderr, flush=True)
        installer(reqs, dest)
        done += reqs
        asked |= {canonicalize_name(Requirement(r).name) for r in reqs}
        reqs = unmet_in(dest, asked)
    raise OverlayError(f"the dependencies for the test runs still grow after {ROUNDS} rounds "
                       f"(last: {', '.join(reqs)}); install them into the environment instead")


def pip_target(reqs: list[str], dest: Path) -> None:
    """``pip install --no-deps --target dest`` of binary wheels."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--target", str(dest), *reqs]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise OverlayError(f"pip could not install {' '.join(reqs)} for the test runs: {last}")


def release_deps(release: str, wheel: Path, *, cache: Path | None = None,
                 installer: Installer | None = None) -> Path | None:
    """The folder of what ``wheel`` (release ``release``) needs beyond this environment, installed
    once; None when the environment satisfies it."""
    reqs = unmet(wheel)
    if not reqs:
        return None
    key = digest.of_text("\n".join([wheel.name, sys.version, "closure", *reqs]))[:12]
    root = (cache or cache_dir()) / "deps"
    dest = root / f"{release}-{key}"
    if (dest / DONE).is_file():
        return dest
    print(f"deps {release}: installing what it pins beyond this environment: {', '.join(reqs)}",
          file=sys.stderr, flush=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=root))
    try:
        done = install_closure(reqs, tmp, installer or pip_target)
        (tmp / DONE).write_text("\n".join(done) + "\n")
        if dest.exists():
            shutil.rmtree(dest)  # an earlier attempt that did not complete
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest


def deps_for(wheels: dict[str, Path]) -> Callable[[str], Path | None]:
    """``deps(release)`` for a test runner: :func:`release_deps` of ``wheels[release]``, made once per
    release and only when a run needs it; None for a release not in ``wheels``."""
    made: dict[str, Path | None] = {}

    def deps(release: str) -> Path | None:
        if release not in wheels:
            return None
        if release not in made:
            made[release] = release_deps(release, wheels[release])
        return made[release]

    return deps
