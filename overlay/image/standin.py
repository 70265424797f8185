"""The CPU stand-in for the official ``vllm/vllm-openai`` image, from Debian packages and PyPI only.

``make image-smoke`` builds our image on it where the real base (Docker Hub, CUDA, about 20 GB)
cannot be had. Recipe: ``docker/standin-base/Containerfile``; this module writes its context into
the cache (``<cache>/standin/<version>/``) and builds it with the selected engine:

- ``rootfs.tar``: Debian :data:`SUITE` from ``mmdebstrap --variant=minbase`` with Python and pip;
- ``wheelhouse/``: ``pip download`` on this machine for the image's Python (:data:`PYTHON`,
  manylinux up to glibc :data:`GLIBC`): the pinned vLLM wheel's ``Requires-Dist`` less
  ``docker/standin-base/leave-out.txt`` and :data:`overlay.build.install.CPU_SKIP`, torch as this
  machine's pip resolves vLLM's pin (or ``--torch``), and the verified vLLM wheel itself.

The image is tagged ``localhost/vllm-overlay-standin:v<version>`` (never the real name, so a
real base on the same machine is not shadowed) and labelled with a digest of its recipe: a later
run with the same recipe reuses it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from overlay.atomic import child_tmpdir
from overlay.build.fetch import cache_dir, fetch_wheel
from overlay.build.install import CPU_SKIP, requirements
from overlay.build.pins import load_pin
from overlay.errors import OverlayError
from overlay.image.containers import Engine

RECIPE = Path("docker/standin-base")
SUITE = "bookworm"  # its python3 is 3.11, the Python of the CPU torch wheels we have
INCLUDE = ("python3", "python3-pip", "ca-certificates")
PYTHON = "3.11"
GLIBC = 36  # bookworm's glibc 2.36: manylinux_2_5 .. manylinux_2_36 wheels run there
REPOSITORY = "localhost/vllm-overlay-standin"
RECIPE_LABEL = "vllm-overlay.standin-recipe"


class StandinError(OverlayError):
    """The stand-in base cannot be prepared or built."""


def standin_ref(version: str) -> str:
    return f"{REPOSITORY}:v{version}"


def leave_out(repo: Path) -> frozenset[str]:
    """The canonical names in ``leave-out.txt`` (plus :data:`CPU_SKIP`)."""
    path = repo / RECIPE / "leave-out.txt"
    try:
        text = path.read_text()
    except OSError as exc:
        raise StandinError(f"{path}: cannot read ({exc.strerror})") from None
    names = {canonicalize_name(line.split("#", 1)[0].strip()) for line in text.splitlines()}
    return frozenset(names - {""}) | CPU_SKIP


def standin_requirements(base_wheel: Path, repo: Path, torch: str = "") -> list[str]:
    """requirements.txt of the wheelhouse: vLLM's requirements for :data:`PYTHON` on a CPU.

    ``torch``: a torch wheel file to use instead of what pip resolves for vLLM's pin."""
    reqs = requirements(base_wheel, python_version=PYTHON, skip=leave_out(repo))
    if not torch:
        return reqs
    return [f"torch=={_torch_version(torch)}", *(r for r in reqs if Requirement(r).name != "torch")]


def _torch_version(path: str) -> str:
    """The version of the torch wheel file ``path`` (``--torch``), or a one-line error."""
    p = Path(path)
    if not p.is_file():
        raise StandinError(f"--torch {path}: no such wheel file")
    try:
        name, version, _, _ = parse_wheel_filename(p.name)
    except ValueError as exc:
        raise StandinError(f"--torch {path}: not a wheel file name ({exc})") from None
    if name != "torch":
        raise StandinError(f"--torch {path}: a wheel of {name!r}, not torch")
    return str(version)


def recipe_digest(repo: Path, reqs: list[str], base_sha256: str) -> str:
    """What the stand-in is made of: its Containerfile, Debian suite and packages, requirements, vLLM wheel."""
    h = hashlib.sha256()
    h.update((repo / RECIPE / "Containerfile").read_bytes())
    h.update(f"\n{SUITE} {' '.join(INCLUDE)} python {PYTHON} glibc 2.{GLIBC}\n".encode())
    h.update("\n".join(reqs).encode())
    h.update(f"\nvllm {base_sha256}\n".encode())
    return h.hexdigest()


def pip_download_command(reqfile: Path, dest: Path, find_links: str = "") -> list[str]:
    """``pip download`` of binary wheels for the stand-in's Python and glibc, with this machine's pip
    configuration (its index and find-links decide which torch build comes)."""
    platforms = [arg for m in range(5, GLIBC + 1) for arg in ("--platform", f"manylinux_2_{m}_x86_64")]
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--progress-bar", "off",
           "--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp",
           "--abi", f"cp{PYTHON.replace('.', '')}", *platforms, "-d", str(dest), "-r", str(reqfile)]
    return cmd + (["--find-links", find_links] if find_links else [])


def _step(message: str) -> None:
    print(f"image-smoke: {message}", file=sys.stderr, flush=True)


def _run(cmd: list[str], what: str) -> None:
    t0 = time.perf_counter()
    with child_tmpdir() as env:  # pip's (and mmdebstrap's) temporaries in a folder the next run sweeps
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr, check=False,
                              env=env)
    if proc.returncode != 0:
        raise StandinError(f"{what} failed (exit {proc.returncode}): `{' '.join(cmd[:4])} ...`; its output is above")
    _step(f"{what}: done in {time.perf_counter() - t0:.0f} s")


def mmdebstrap() -> str:
    """The ``mmdebstrap`` executable, or a one-line :class:`StandinError`."""
    exe = shutil.which("mmdebstrap")
    if exe is None:
        raise StandinError("mmdebstrap is not on PATH: the stand-in's Debian rootfs is made with it "
                           "(apt-get install mmdebstrap; docs/image/README.md)")
    return exe


def _rootfs(work: Path) -> Path:
    """Debian :data:`SUITE` as a tarball, made once per cache."""
    out = work / f"rootfs-{SUITE}.tar"
    if out.is_file():
        _step(f"rootfs: reusing {out}")
        return out
    exe = mmdebstrap()
    tmp = work / f".rootfs-{SUITE}.{os.getpid()}.tar"  # this run's own: another run may be writing its own
    _step(f"rootfs: mmdebstrap --variant=minbase --include={','.join(INCLUDE)} {SUITE} (about a minute)")
    _run([exe, "--variant=minbase", f"--include={','.join(INCLUDE)}", SUITE, str(tmp)], "mmdebstrap")
    tmp.replace(out)
    return out


def _wheelhouse(work: Path, reqs: list[str], key: str, base_wheel: Path, torch: str) -> Path:
    """The downloaded wheels (once per recipe digest) and requirements.txt."""
    house = work / f"wheelhouse-{key[:12]}"
    done = house / ".complete"
    if done.is_file():
        _step(f"wheelhouse: reusing {house}")
        return house
    house.mkdir(parents=True, exist_ok=True)
    reqfile = house / "requirements.txt"
    reqfile.write_text("".join(f"{r}\n" for r in reqs))
    _step(f"wheelhouse: pip download of {len(reqs)} requirement(s) for Python {PYTHON} into {house}")
    if torch:
        shutil.copy2(torch, house / Path(torch).name)
    _run(pip_download_command(reqfile, house, str(house) if torch else ""), "pip download")
    _link(base_wheel, house / base_wheel.name)
    done.write_text(key + "\n")
    return house


def _link(src: Path, dest: Path) -> None:
    if dest.exists():
        dest.unlink()
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def build_standin(engine: Engine, repo: Path, patches_root: Path, version: str, *, torch: str = "") -> str:
    """Build (or reuse) the stand-in of release ``version`` with ``engine``; return its reference."""
    pin = load_pin(patches_root, version)
    base_wheel = fetch_wheel(pin)
    reqs = standin_requirements(base_wheel, repo, torch)
    key = recipe_digest(repo, reqs, pin.sha256)
    ref = standin_ref(pin.version)
    if engine.exists(ref) and engine.config(ref)["Labels"].get(RECIPE_LABEL) == key:  # type: ignore[union-attr]
        _step(f"stand-in: reusing {ref} (recipe {key[:12]})")
        return ref
    work = cache_dir() / "standin" / pin.version
    work.mkdir(parents=True, exist_ok=True)
    rootfs = _rootfs(work)
    house = _wheelhouse(work, reqs, key, base_wheel, torch)
    context = work / "context"
    shutil.rmtree(context, ignore_errors=True)
    (context / "wheelhouse").mkdir(parents=True)
    _link(rootfs, context / "rootfs.tar")
    for f in house.iterdir():
        if f.suffix in (".whl", ".txt"):
            _link(f, context / "wheelhouse" / f.name)
    cmd = engine.build_command(dockerfile=str((repo / RECIPE / "Containerfile").resolve()), context=str(context),
                               build_args={"VLLM_WHEEL": base_wheel.name}, labels={RECIPE_LABEL: key},
                               tags=[ref], layers=False)
    _step(f"stand-in: building {ref} with {engine.name} (pip installs {len(reqs)} requirement(s): minutes)")
    t0 = time.perf_counter()
    rc = engine.call(cmd).returncode
    shutil.rmtree(context, ignore_errors=True)
    if rc != 0:
        raise StandinError(f"stand-in build failed (exit {rc}); {engine.name}'s output is above")
    _step(f"stand-in: built {ref} in {time.perf_counter() - t0:.0f} s")
    return ref
