"""``make device-stage``: everything vLLM's engine needs on the GPU device machine, in carries.

The device machine (docs/ARCHITECTURE.md, "How the patched vLLM is tested without the real model") has
Python 3.12, torch 2.11, Triton 3.6 and the packages listed in ``scripts/device-packages.txt``,
but no vLLM and no network; one call to it brings at most 64 MiB, repository included. This
module stages, from the patched wheel that ``make build`` wrote:

- vLLM's Python tree with its dist-info (one deterministic ``.tar.xz``, without the ``vllm-rs``
  binary, ``third_party/fmha_sm100`` and every compiled library),
- the compiled kernels the device can use, one ``.xz`` each (:data:`KEEP_KERNELS`; the others
  are listed in the manifest with the reason they were left out),
- the Python wheels vLLM needs that the device lacks: vLLM's ``Requires-Dist`` (markers
  evaluated for CPython 3.12 on Linux x86_64, vLLM's extras not requested, torch,
  torchvision and torchaudio left out: the device's torch 2.11 is used on purpose), resolved
  transitively by pip for that target with every device package pinned to its device version.
  A pin that makes the resolution impossible is dropped (the conflict is the reason, recorded)
  and the package is staged in the version the requirements force; a device package is never
  staged otherwise.

and packs them into carry folders ``.device/<name>/carry-NN/`` of at most 60 MiB each (largest
first; a larger file is split into ``.part-NN`` pieces), each with a copy of ``manifest.json``
(sha256 of every piece and file, the resolution log, the staged wheels).
``scripts/device-run.sh`` unpacks them on the device. Same inputs, same carries: sorted
orders, fixed xz settings, a tar with sorted names and fixed owner and mtime.

Device packages are pinned through stub wheels: for each one a metadata-only wheel
``<name>-<version>+device`` with no dependencies, and the constraint ``<name>==<version>+device``.
pip then treats them as present without fetching them (torch alone is 530 MB) or resolving
their own dependencies, which the device already satisfies (its torch needs an NCCL build that
is not on PyPI).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from email.parser import BytesParser
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from overlay.archive import tar_bytes
from overlay.atomic import replacing_dir, write_file
from overlay.errors import OverlayError
from overlay.fetch import cache_dir, sha256_file
from overlay.wheel import dist_info_name, record_hash

MIB = 2**20
CARRY_LIMIT = 60 * MIB
CALL_LIMIT = 64 * MIB  # what one device call carries in all: the carry plus the checkout's own files
MANIFEST_RESERVE = MIB  # room kept in every carry for its copy of manifest.json
XZ_PRESET = 6
STUB_LABEL = "device"
TORCH_FAMILY = frozenset({"torch", "torchvision", "torchaudio"})
# What the overlay's own modules that run on the device import beyond vLLM's requirements
# (overlay.bench.engine, overlay.regress), pinned as in pyproject.toml: `overlay device-stage` adds
# them to its --extra requirements.
HARNESS_REQUIREMENTS: tuple[str, ...] = ("httpx-sse==0.4.3",)

# vLLM requirements (or their dependencies) that no engine run of a text-only sparse-MLA model on
# Hopper imports, each with why; left out unless ``full`` (about half of the bytes: 8 carries).
# numba stays although it is imported lazily: without vLLM's numba==0.65 the device's numpy 2.5
# stays pinned and pip backtracks xgrammar into versions that need transformers < 5.
NOT_NEEDED: dict[str, str] = {
    "tokenspeed-mla": "TokenSpeed MLA backends; Hopper sparse MLA runs FlashMLA-sparse",
    "tokenspeed-triton": "TokenSpeed's Triton fork (for tokenspeed-mla)",
    "humming-kernels": "JIT kernels of other models; its [cu13] extra brings CUDA 13.5 nvcc/nvvm "
                       "(the device has its own CUDA 13.0 toolkit)",
    "nvidia-cuda-nvcc": "CUDA 13.5 compiler wheel (for humming-kernels); the device has nvcc 13.0",
    "nvidia-nvvm": "CUDA 13.5 NVVM wheel (for humming-kernels)",
    "nvidia-cuda-crt": "CUDA 13.5 runtime headers wheel (for humming-kernels)",
    "nvidia-cuda-cccl": "CUDA 13.5 CCCL headers wheel (for humming-kernels)",
    "tilelang": "TileLang kernels (vllm/tilelang_utils: mHC of other models)",
    "z3-solver": "SMT solver of tilelang",
    "pynvvideocodec": "video decoding (vllm/multimodal/video.py)",
    "torchcodec": "video/audio decoding (multimodal inputs); built for torch 2.13, not the device's 2.11",
    "nvidia-cutlass-dsl-libs-cu12": "CuteDSL's CUDA 12 libraries; the [cu13] ones serve the device's CUDA 13",
}

# Markers of the device's interpreter: CPython 3.12.3 on Linux x86_64.
DEVICE_ENV: dict[str, str] = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "platform_release": "",
    "platform_version": "",
}

# Binary wheels for the device; glibc of the device (Python 3.12.3: Ubuntu 24.04) is newer than
# every tag listed, newest first so that pip prefers the most specific build.
PLATFORMS: tuple[str, ...] = (
    *(f"manylinux_2_{n}_x86_64" for n in range(35, 16, -1)),
    "manylinux2014_x86_64",
    *(f"manylinux_2_{n}_x86_64" for n in range(16, 4, -1)),
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "any",
)

# Compiled libraries of the wheel that travel (each as its own .xz), and why the others stay.
KEEP_KERNELS: tuple[str, ...] = (
    "vllm/_C_stable_libtorch.abi3.so",
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/_flashmla_C.abi3.so",
    "vllm/_flashmla_extension_C.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/_flashkda_C.abi3.so",
    "vllm/_qutlass_C.abi3.so",
    "vllm/_rust_tool_parser.abi3.so",
    "vllm/cumem_allocator.abi3.so",
    "vllm/fs_io_C.abi3.so",
    "vllm/spinloop.abi3.so",
)
LEFT_OUT: tuple[tuple[str, str], ...] = (
    ("vllm/vllm-rs", "the Rust front-end binary (54 MB); the engine runs from Python"),
    ("vllm/third_party/fmha_sm100/", "Blackwell (sm100) attention kernels; the device is Hopper"),
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
     "FlashAttention 2 (308 MB, 2+ carries as .xz); Hopper uses FA3, and vLLM imports FA2 in a try"),
    ("vllm/third_party/deep_gemm/_C.",
     "vendored DeepGEMM extension: built against torch's C++ ABI, it does not load on the device's "
     "torch 2.11 (docs/ARCHITECTURE.md); a deep_gemm stand-in on PYTHONPATH takes its place"),
)


class DeviceStageError(OverlayError):
    """The device staging could not resolve, fetch or pack what vLLM needs."""


_CLOCK = {"start": time.monotonic()}


def checkout_bytes(repo: Path) -> int:
    """The bytes a device call copies besides the carry: tracked and untracked-not-ignored files."""
    from overlay.git import git_text

    names = git_text(["ls-files", "-z", "--cached", "--others", "--exclude-standard"], repo).split("\0")
    return sum((repo / n).stat().st_size for n in names if n and (repo / n).is_file())


def carry_limit(repo: Path, wanted: int = CARRY_LIMIT, margin: int = MIB) -> int:
    """``wanted``, or less when the checkout is so large that carry + checkout would pass ``CALL_LIMIT``."""
    used = checkout_bytes(repo)
    room = CALL_LIMIT - used - margin
    if room < 8 * MIB:
        raise DeviceStageError(f"{repo}: the checkout's own files take {used / MIB:.1f} MiB of "
                               f"the {CALL_LIMIT // MIB} MiB a device call carries; move large files out of git")
    return min(wanted, room)


def with_harness(extras: Sequence[str]) -> list[str]:
    """``extras`` with ``HARNESS_REQUIREMENTS`` first, each once."""
    return [*HARNESS_REQUIREMENTS, *(e for e in extras if e not in HARNESS_REQUIREMENTS)]


def log(message: str) -> None:
    """One progress line on stderr: ``[device-stage mm:ss] message``."""
    elapsed = int(time.monotonic() - _CLOCK["start"])
    print(f"[device-stage {elapsed // 60:02d}:{elapsed % 60:02d}] {message}", file=sys.stderr, flush=True)


# --- requirements ---------------------------------------------------------------------------


def read_device_packages(path: Path) -> dict[str, str]:
    """``pip freeze`` lines (``name==version``) -> canonical name -> version."""
    packages: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise DeviceStageError(f"{path}:{lineno}: expected name==version, got {raw!r}")
        packages[canonicalize_name(name.strip())] = version.strip()
    return packages


def wheel_requires_dist(wheel: Path) -> tuple[str, list[str]]:
    """The wheel's version and its ``Requires-Dist`` lines, as METADATA has them."""
    with zipfile.ZipFile(wheel) as zf:
        dist_info = dist_info_name(zf.infolist(), wheel)
        meta = BytesParser().parsebytes(zf.read(f"{dist_info}/METADATA"))
    return str(meta["Version"]), list(meta.get_all("Requires-Dist") or [])


def device_requirements(requires_dist: Iterable[str], env: Mapping[str, str] = DEVICE_ENV,
                        exclude: frozenset[str] = TORCH_FAMILY,
                        not_needed: Mapping[str, str] | None = None) -> tuple[list[str], list[str]]:
    """Split ``Requires-Dist`` into what to resolve for the device and what is left out, with why.

    Markers are evaluated for ``env`` with no extra requested (vLLM's own extras stay out);
    a requirement's extras (``nvidia-cutlass-dsl[cu13]``) are kept. The kept strings carry no
    marker any more.
    """
    kept: list[str] = []
    skipped: list[str] = []
    for line in requires_dist:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            skipped.append(f"{line}: marker false for the device")
            continue
        if canonicalize_name(req.name) in exclude:
            skipped.append(f"{line}: the device's own build is used")
            continue
        if not_needed and canonicalize_name(req.name) in not_needed:
            skipped.append(f"{line}: not needed on the device: {not_needed[canonicalize_name(req.name)]}")
            continue
        req.marker = None
        kept.append(str(req))
    return kept, skipped


# --- pip conflicts --------------------------------------------------------------------------


@dataclass(frozen=True)
class Conflict:
    """pip's "The conflict is caused by:" block: the constraint pins it names, and its lines."""

    constraints: tuple[str, ...]  # canonical names, in the order pip printed them
    lines: tuple[str, ...]

    def reason(self, name: str) -> str:
        """The block's lines about ``name`` (all of them if none names it), for the log."""
        about = list(dict.fromkeys(line for line in self.lines if _required_name(line) == name))
        about = about or list(dict.fromkeys(self.lines))
        more = f"; ... ({len(about) - 4} more)" if len(about) > 4 else ""
        return ("; ".join(about[:4]) + more).replace("The user requested ", "vllm requires ")


_CONSTRAINT = re.compile(r"^The user requested \(constraint\) ([A-Za-z0-9][A-Za-z0-9._-]*)")
_REQUIRED = re.compile(r"(?:depends on|The user requested) ([A-Za-z0-9][A-Za-z0-9._-]*)")


def _required_name(line: str) -> str | None:
    found = _REQUIRED.search(line)
    return canonicalize_name(found[1]) if found else None


def parse_conflict(output: str) -> Conflict | None:
    """The conflict pip reports with ``ResolutionImpossible``, or None when there is none."""
    lines = output.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "The conflict is caused by:")
    except StopIteration:
        return None
    block: list[str] = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        block.append(line.strip())
    pins = [canonicalize_name(m[1]) for m in map(_CONSTRAINT.match, block) if m]
    others = tuple(line for line in block if not _CONSTRAINT.match(line))
    return Conflict(tuple(dict.fromkeys(pins)), others)


def pip_error_tail(output: str, lines: int = 3) -> str:
    """The last ``ERROR:`` lines pip printed (or its last lines), one string."""
    errors = [line.strip() for line in output.splitlines() if line.startswith("ERROR:")]
    tail = errors or [line.strip() for line in output.splitlines() if line.strip()]
    return " | ".join(tail[-lines:]) or "no output"


# --- resolution -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedWheel:
    """One wheel of pip's resolution that the device lacks."""

    name: str
    version: str
    filename: str
    url: str
    sha256: str | None


@dataclass(frozen=True)
class DroppedPin:
    """A device package pin that made the resolution impossible."""

    name: str
    device_version: str
    reason: str


@dataclass(frozen=True)
class PipOutcome:
    """One resolver run: success, pip's output, and its ``--report`` when it succeeded."""

    ok: bool
    output: str
    report: dict | None = None


PipRun = Callable[[Sequence[str], Mapping[str, str]], PipOutcome]
"""``run(requirements, pins)``: resolve ``requirements`` with device packages ``pins`` (name -> version)."""


@dataclass
class Resolution:
    """What the resolver settled on."""

    wheels: list[ResolvedWheel]
    dropped: list[DroppedPin]
    rounds: int
    restored: list[str] = field(default_factory=list)
    required_by: dict[str, list[str]] = field(default_factory=dict)
    built: dict[str, str] = field(default_factory=dict)  # name -> wheel built from its sdist (pure Python)


def stub_version(version: str) -> str:
    """The stub's version: the device's, with the local label ``device``."""
    return f"{version}.{STUB_LABEL}" if "+" in version else f"{version}+{STUB_LABEL}"


def is_stub(version: str) -> bool:
    try:
        local = Version(version).local
    except InvalidVersion:
        return False
    return local is not None and local.split(".")[-1] == STUB_LABEL


def wheels_from_report(report: dict) -> list[ResolvedWheel]:
    """The resolved wheels of a ``pip install --report``, stubs (device packages) left out, by name."""
    wheels = []
    for item in report.get("install", []):
        meta, info = item["metadata"], item["download_info"]
        if is_stub(meta["version"]):
            continue
        archive = info.get("archive_info", {})
        digest = archive.get("hashes", {}).get("sha256")
        if digest is None and str(archive.get("hash", "")).startswith("sha256="):
            digest = archive["hash"].split("=", 1)[1]
        url = info["url"]
        wheels.append(ResolvedWheel(canonicalize_name(meta["name"]), meta["version"],
                                    url.rsplit("/", 1)[-1].split("#", 1)[0], url, digest))
    return sorted(wheels, key=lambda w: w.name)


def required_by(report: dict, requirements: Sequence[str], env: Mapping[str, str] = DEVICE_ENV,
                extra_requirements: Sequence[str] = ()) -> dict[str, list[str]]:
    """Who asks for each package of a resolution: ``vllm`` (its own requirements), ``extra`` (the
    ``--extra`` requirements) or resolved packages."""
    who: dict[str, set[str]] = {}
    extras: dict[str, set[str]] = {}  # the extras asked of each package, anywhere in the graph
    for label, lines in (("vllm", requirements), ("extra", extra_requirements)):
        for line in lines:
            req = Requirement(line)
            who.setdefault(canonicalize_name(req.name), set()).add(label)
            extras.setdefault(canonicalize_name(req.name), set()).update(req.extras)
    items = [(canonicalize_name(i["metadata"]["name"]), _parse_all(i["metadata"].get("requires_dist") or []))
             for i in report.get("install", [])]
    for name, _ in items:
        extras.setdefault(name, set())
    for item in report.get("install", []):
        extras[canonicalize_name(item["metadata"]["name"])].update(item.get("requested_extras") or [])
    changed = True
    while changed:  # extras propagate (fastapi[standard] -> uvicorn[standard] -> websockets)
        changed = False
        for name, reqs in items:
            for req in reqs:
                if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e})
                                                      for e in ["", *sorted(extras[name])]):
                    continue
                child = canonicalize_name(req.name)
                before = (len(who.get(child, ())), len(extras.get(child, ())))
                who.setdefault(child, set()).add(name)
                extras.setdefault(child, set()).update(req.extras)
                changed |= before != (len(who[child]), len(extras[child]))
    return {name: sorted(parents) for name, parents in sorted(who.items())}


def _parse_all(lines: Iterable[str]) -> list[Requirement]:
    reqs = []
    for line in lines:
        try:
            reqs.append(Requirement(line))
        except InvalidRequirement:
            continue
    return reqs


RESOLVE_MAX_ROUNDS = 30

_NO_DISTRIBUTION = re.compile(r"^ERROR: No matching distribution found for (\S+)", re.MULTILINE)


def missing_distribution(output: str) -> str | None:
    """The requirement pip found no distribution for (``rouge-score>=0.0.4``), or None."""
    found = _NO_DISTRIBUTION.search(output)
    return found[1] if found else None


SdistBuild = Callable[[str], str]
"""``build(requirement)``: a wheel for ``requirement`` built from its sdist where pip finds it (see
:func:`sdist_builder`); returns the wheel's file name, or raises :class:`DeviceStageError`."""


def resolve(requirements: Sequence[str], device: Mapping[str, str], run: PipRun, *,
            max_rounds: int = RESOLVE_MAX_ROUNDS, restore: bool = True, build: SdistBuild | None = None,
            extra_requirements: Sequence[str] = ()) -> Resolution:
    """Resolve with every device package pinned; drop the pins pip names in a conflict, retry.

    A conflict that names no droppable pin (none, or only the torch family, which stays the
    device's) stops with pip's error. A conflict naming several pins drops them all; after a
    success each of those is tried back alone, in name order (``restore``), since one of them
    may have been enough. A pin that was alone in its conflict is not tried again (each try is
    a full resolution, 30-70 s).

    A package with no wheel for the device stops with pip's error, unless ``build`` is given: it
    builds a pure-Python wheel from the package's sdist (where pip finds it next round) or says
    in one line why it cannot; a package is built at most once. ``extra_requirements`` are
    resolved together with ``requirements`` (one set), and reported as asked by ``extra``.
    """
    pins = {canonicalize_name(k): v for k, v in device.items()}
    dropped: dict[str, DroppedPin] = {}
    together: set[str] = set()
    built: dict[str, str] = {}
    asked = [*requirements, *extra_requirements]
    what = "vLLM's requirements" + (" and the extra ones" if extra_requirements else "")
    for rounds in range(1, max_rounds + 1):
        log(f"resolve round {rounds}: {len(asked)} requirement(s), {len(pins)} device pin(s)")
        outcome = run(asked, pins)
        if outcome.ok:
            break
        conflict = parse_conflict(outcome.output) or Conflict((), ())
        names = [n for n in conflict.constraints if n in pins and n not in TORCH_FAMILY]
        missing = missing_distribution(outcome.output) if not names else None
        if missing is not None and build is not None:
            name = _requirement_name(missing)
            if name in built:
                raise DeviceStageError(f"{name}: pip finds no wheel for the device even after building "
                                       f"{built[name]} from its sdist: {pip_error_tail(outcome.output)}")
            built[name] = build(missing)
            continue
        if not names:
            raise DeviceStageError(f"pip cannot resolve {what} for the device: "
                                   f"{pip_error_tail(outcome.output)}")
        if len(names) > 1:
            together.update(names)
        for name in names:
            dropped[name] = DroppedPin(name, pins.pop(name), conflict.reason(name))
            log(f"  dropped device pin {name}=={dropped[name].device_version}: {dropped[name].reason}")
    else:
        raise DeviceStageError(f"no resolution after {max_rounds} rounds; dropped so far: {sorted(dropped)}")
    restored: list[str] = []
    if restore:
        for name in sorted(together):
            trial = {**pins, name: dropped[name].device_version}
            log(f"restore: does the device's {name}=={trial[name]} fit after all?")
            again = run(asked, trial)
            if again.ok:
                pins, outcome = trial, again
                restored.append(name)
                del dropped[name]
    assert outcome.report is not None
    return Resolution(wheels_from_report(outcome.report), sorted(dropped.values(), key=lambda d: d.name),
                      rounds, restored, required_by(outcome.report, requirements,
                                                    extra_requirements=extra_requirements),
                      dict(sorted(built.items())))


def _requirement_name(text: str) -> str:
    try:
        return canonicalize_name(Requirement(text).name)
    except InvalidRequirement:
        return canonicalize_name(re.split(r"[<>=!~;\[ ]", text, maxsplit=1)[0])


def write_stub_wheel(folder: Path, name: str, version: str) -> Path:
    """A metadata-only wheel ``name-<version>+device-py3-none-any.whl`` with no dependencies."""
    dist = re.sub(r"[-_.]+", "_", name)
    full = stub_version(version)
    dist_info = f"{dist}-{full}.dist-info"
    files = {
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {full}\n\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: vllm-overlay\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n",
    }
    path = folder / f"{dist}-{full}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
            record.append(f"{member},{record_hash(data)},{len(data)}\n")
        zf.writestr(f"{dist_info}/RECORD", "".join(record) + f"{dist_info}/RECORD,,\n")
    return path


def target_args(platforms: Sequence[str] = PLATFORMS) -> list[str]:
    """pip's options selecting binary wheels for CPython 3.12 on the device's platform."""
    args = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for plat in platforms:
        args += ["--platform", plat]
    return args


@dataclass(frozen=True)
class Resolver:
    """The interpreter that runs pip for the device (a CPython 3.12: markers are evaluated there)."""

    python: str
    description: str
    exact: bool  # False: not a CPython 3.12, dependencies' markers evaluated for another Python


def find_resolver(explicit: str | None = None) -> Resolver:
    """A CPython 3.12 with pip >= 22.2 (``--report``): ``explicit``, then python3.12, pyenv's, this one."""
    candidates = [explicit] if explicit else []
    candidates += [os.environ.get("OVERLAY_RESOLVER_PYTHON", ""), "python3.12",
                   *sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12")),
                   sys.executable]
    probe = ("import platform, sys, pip; print(platform.python_implementation(), platform.python_version(), "
             "pip.__version__)")
    for cand in filter(None, candidates):
        try:
            proc = subprocess.run([cand, "-c", probe], capture_output=True, text=True, check=False, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if proc.returncode != 0:
            continue
        impl, pyver, pipver = proc.stdout.split()
        pip_ok = tuple(int(x) for x in re.findall(r"\d+", pipver)[:2]) >= (22, 2)
        exact = impl == "CPython" and pyver.startswith("3.12.")
        if pip_ok and (exact or cand == explicit or cand == sys.executable):
            return Resolver(cand, f"{impl} {pyver}, pip {pipver}", exact)
    raise DeviceStageError("no Python with pip >= 22.2 found to resolve for the device (--resolver-python)")


def pip_runner(resolver: Resolver, work: Path, platforms: Sequence[str] = PLATFORMS,
               wheelhouse: Path | None = None) -> PipRun:
    """A :data:`PipRun` that calls ``pip install --dry-run --report`` with stub wheels for the pins
    (and the wheels :func:`sdist_builder` built, in ``wheelhouse``, when given)."""

    def run(requirements: Sequence[str], pins: Mapping[str, str]) -> PipOutcome:
        with tempfile.TemporaryDirectory(dir=work, prefix="resolve-") as tmp:
            root = Path(tmp)
            stubs = root / "stubs"
            stubs.mkdir()
            for name, version in sorted(pins.items()):
                write_stub_wheel(stubs, name, version)
            (root / "requirements.txt").write_text("".join(f"{r}\n" for r in requirements))
            (root / "constraints.txt").write_text(
                "".join(f"{n}=={stub_version(v)}\n" for n, v in sorted(pins.items())))
            cmd = [resolver.python, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                   "--disable-pip-version-check", "--progress-bar", "off",
                   "--report", str(root / "report.json"), "--target", str(root / "target"),
                   *target_args(platforms), "--find-links", str(stubs),
                   *(["--find-links", str(wheelhouse)] if wheelhouse is not None else []),
                   "-c", str(root / "constraints.txt"), "-r", str(root / "requirements.txt")]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
            if proc.returncode != 0:
                return PipOutcome(False, proc.stdout)
            return PipOutcome(True, proc.stdout, json.loads((root / "report.json").read_text()))

    return run


SDIST_EPOCH = "315532800"  # SOURCE_DATE_EPOCH of wheels built from sdists (1980-01-01): same sdist, same wheel


def is_pure_wheel(filename: str) -> bool:
    """Whether a wheel file name's tags are all pure Python (``py3-none-any``, ``py2.py3-none-any``)."""
    try:
        tags = parse_wheel_filename(filename)[3]
    except InvalidWheelFilename:
        return False
    return bool(tags) and all(t.interpreter.startswith("py") and t.abi == "none" and t.platform == "any"
                              for t in tags)


def sdist_builder(resolver: Resolver, wheelhouse: Path) -> SdistBuild:
    """A :data:`SdistBuild`: ``pip wheel --no-deps --no-binary NAME`` into ``wheelhouse`` (which the
    resolver searches, :func:`pip_runner`), keeping the wheel only if it is pure Python: a wheel built
    here for a compiled package would be for this machine's Python, not the device's CPython 3.12."""

    def build(requirement: str) -> str:
        name = _requirement_name(requirement)
        wheelhouse.mkdir(parents=True, exist_ok=True)
        log(f"{name}: no wheel for the device; building one from its sdist ({requirement})")
        with tempfile.TemporaryDirectory(dir=wheelhouse, prefix=".build-") as tmp:
            cmd = [resolver.python, "-m", "pip", "wheel", "--no-deps", "--no-binary", name,
                   "--disable-pip-version-check", "--progress-bar", "off", "-w", tmp, requirement]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                  env={**os.environ, "SOURCE_DATE_EPOCH": SDIST_EPOCH})
            out = proc.stdout + proc.stderr
            got = sorted(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or len(got) != 1:
                if missing_distribution(out) is not None:
                    raise DeviceStageError(f"{name}: no wheel for CPython 3.12 manylinux x86_64 and no sdist "
                                           f"to build one from ({requirement}): {pip_error_tail(out, 1)}")
                raise DeviceStageError(f"{name}: no wheel for the device, and building its sdist failed "
                                       f"({requirement}): {pip_error_tail(out, 1)}")
            wheel = got[0]
            if canonicalize_name(parse_wheel_filename(wheel.name)[0]) != name:
                raise DeviceStageError(f"{name}: pip wheel built {wheel.name}, another package")
            if not is_pure_wheel(wheel.name):
                raise DeviceStageError(f"{name}: no wheel for the device, and its sdist builds {wheel.name}, "
                                       "not pure Python: it cannot be built here for the device's CPython 3.12")
            os.replace(wheel, wheelhouse / wheel.name)
        log(f"  built {wheel.name} (pure Python) into {wheelhouse}")
        return wheel.name

    return build


# --- the resolution cache -------------------------------------------------------------------

RESOLUTION_CACHE_FORMAT = 1
# how extra requirements are resolved (in the key of such resolutions): on top of vLLM's own resolution,
# its dropped pins stay dropped, a device package is never staged older than the device's
EXTRA_POLICY = "over-vllm-resolution; no-downgrade; pure-sdist-builds"
# pip settings from the environment that change what it resolves (hashed into the key, never stored)
PIP_ENV_KEYS: tuple[str, ...] = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX",
                                 "PIP_CONSTRAINT", "PIP_PRE")


def resolution_key(requirements: Sequence[str], device: Mapping[str, str], resolver: Resolver, *,
                   platforms: Sequence[str] = PLATFORMS, max_rounds: int = RESOLVE_MAX_ROUNDS,
                   restore: bool = True, extra_requirements: Sequence[str] = ()) -> str:
    """sha256 of everything :func:`resolve` depends on, not of the wheel: a patch edit changes the
    wheel's version and sha256 but not its ``Requires-Dist``, and so keeps the key. The
    ``--extra`` requirements enter only when there are some (without, the key is what it was)."""
    inputs = {
        "format": RESOLUTION_CACHE_FORMAT,
        "requirements": list(requirements),
        "device_packages": sorted((canonicalize_name(k), v) for k, v in device.items()),
        "target": target_args(platforms),
        "markers": DEVICE_ENV,
        "resolver": [resolver.description, resolver.exact],
        "kept_pins": sorted(TORCH_FAMILY),
        "stub_label": STUB_LABEL,
        "max_rounds": max_rounds,
        "restore": restore,
        "pip_env": [os.environ.get(k, "") for k in PIP_ENV_KEYS],
    }
    if extra_requirements:
        inputs["extra_requirements"] = list(extra_requirements)
        inputs["extra_policy"] = EXTRA_POLICY
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def resolution_cache_file(cache: Path, key: str) -> Path:
    return cache / "device-resolutions" / f"{key}.json"


def _record(item: object, cls: type, optional: frozenset[str] = frozenset()) -> dict:
    """``item`` as the fields of dataclass ``cls``, every one a string (or None where ``optional``)."""
    names = [f.name for f in fields(cls)]
    if not isinstance(item, dict) or sorted(item) != sorted(names):
        raise ValueError(f"not a {cls.__name__}: {item!r}")
    for k, v in item.items():
        if not (isinstance(v, str) or (v is None and k in optional)):
            raise ValueError(f"{cls.__name__}.{k}: {v!r}")
    return item


def resolution_from_json(data: object, key: str) -> Resolution:
    """A :class:`Resolution` from :func:`save_resolution`'s JSON; ValueError if it is not one for ``key``."""
    if not isinstance(data, dict) or data.get("format") != RESOLUTION_CACHE_FORMAT or data.get("key") != key:
        raise ValueError("not a resolution of this format and key")
    rounds, restored, who = data["rounds"], data["restored"], data["required_by"]
    built = data.get("built", {})
    if (not isinstance(rounds, int) or not isinstance(restored, list) or not isinstance(who, dict)
            or not all(isinstance(r, str) for r in restored)
            or not all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in who.values())
            or not isinstance(built, dict) or not all(isinstance(v, str) for v in built.values())):
        raise ValueError("rounds, restored, required_by or built malformed")
    return Resolution([ResolvedWheel(**_record(w, ResolvedWheel, frozenset({"sha256"}))) for w in data["wheels"]],
                      [DroppedPin(**_record(d, DroppedPin)) for d in data["dropped"]],
                      rounds, list(restored), {k: list(v) for k, v in who.items()}, dict(built))


def load_resolution(path: Path, key: str) -> Resolution | None:
    """The cached resolution for ``key``; None if there is none, or (with a warning) if it is unreadable."""
    if not path.exists():
        return None
    try:
        return resolution_from_json(json.loads(path.read_text()), key)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log(f"  warning: cached resolution {path} unreadable ({type(exc).__name__}: {exc}); resolving again")
        return None


def save_resolution(path: Path, key: str, resolution: Resolution) -> None:
    """Write ``resolution`` as JSON, atomically."""
    data = {"format": RESOLUTION_CACHE_FORMAT, "key": key,
            "wheels": [asdict(w) for w in resolution.wheels], "dropped": [asdict(d) for d in resolution.dropped],
            "rounds": resolution.rounds, "restored": resolution.restored, "required_by": resolution.required_by,
            **({"built": resolution.built} if resolution.built else {})}
    write_file(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


# --- fetching -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StagedFile:
    """One file that travels: ``path`` inside the carries, ``kind`` says what the device does with it."""

    path: str  # wheels/<file>.whl, kernels/vllm/<lib>.so.xz, tree/vllm-tree.tar.xz
    kind: str  # wheel | kernel | tree
    source: Path
    size: int
    sha256: str
    target: str | None = None  # kernel: where it unpacks, relative to the site folder
    target_sha256: str | None = None


def download_wheels(wheels: Sequence[ResolvedWheel], cache: Path, resolver: Resolver) -> list[StagedFile]:
    """Each wheel from the cache, or downloaded there (checked against the report's sha256)."""
    cache.mkdir(parents=True, exist_ok=True)
    staged = []
    for i, wheel in enumerate(wheels, 1):
        target = cache / wheel.filename
        state = "cached"
        if not (target.exists() and (wheel.sha256 is None or sha256_file(target) == wheel.sha256)):
            state = "downloaded"
            _download_one(wheel, target, resolver)
        size = target.stat().st_size
        log(f"wheel {i}/{len(wheels)} {wheel.name}=={wheel.version} {size / MIB:.1f} MiB ({state})")
        staged.append(StagedFile(f"wheels/{wheel.filename}", "wheel", target, size, sha256_file(target)))
    return staged


def _download_one(wheel: ResolvedWheel, target: Path, resolver: Resolver) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        got = Path(tmp) / wheel.filename
        if wheel.url.startswith("file://"):
            source = Path(wheel.url.removeprefix("file://"))
            if not source.is_file():
                raise DeviceStageError(f"{wheel.filename}: {source} (built from its sdist) is gone; "
                                       "stage with --no-resolution-cache to build it again")
            shutil.copyfile(source, got)
        else:
            cmd = [resolver.python, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                   "--progress-bar", "off", *target_args(), "-d", tmp, f"{wheel.name} @ {wheel.url}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0 or not got.is_file():
                raise DeviceStageError(f"pip download {wheel.filename} failed ({proc.returncode}): "
                                       f"{pip_error_tail(proc.stdout + proc.stderr)}")
        actual = sha256_file(got)
        if wheel.sha256 is not None and actual != wheel.sha256:
            raise DeviceStageError(f"{wheel.filename}: sha256 mismatch: the index says {wheel.sha256}, "
                                   f"got {actual}")
        os.replace(got, target)


# --- vLLM's tree and kernels ----------------------------------------------------------------


OTHER_LIBRARY = "a compiled library not in KEEP_KERNELS"


def left_out_rule(member: str) -> tuple[str, str] | None:
    """Which rule keeps a wheel member home: ``(path or prefix, why)``; None: it travels."""
    for prefix, why in LEFT_OUT:
        if member == prefix or member.startswith(prefix):
            return prefix, why
    if member.endswith(".so") and member not in KEEP_KERNELS:
        return member, OTHER_LIBRARY
    return None


def summarize_left_out(zf: zipfile.ZipFile, members: Iterable[str]) -> list[dict]:
    """One entry per rule that matched: the path or prefix, how many files and bytes, and why."""
    groups: dict[tuple[str, str], list[int]] = {}
    for name in members:
        rule = left_out_rule(name)
        if rule:
            groups.setdefault(rule, []).append(zf.getinfo(name).file_size)
    return [{"path": path, "files": len(sizes), "bytes": sum(sizes), "why": why}
            for (path, why), sizes in sorted(groups.items())]


def xz_cached(data: bytes, cache: Path) -> Path:
    """``data`` compressed with xz preset :data:`XZ_PRESET` (CRC64), cached by the sha256 of ``data``."""
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"{hashlib.sha256(data).hexdigest()}.p{XZ_PRESET}.xz"
    if not target.exists():
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET))
        os.replace(tmp, target)
    return target


def tree_tar(zf: zipfile.ZipFile, members: Sequence[str]) -> bytes:
    """A reproducible tar of ``members``: mode 644 (755 if executable in the wheel)."""
    return tar_bytes((name, zf.read(name), 0o755 if (zf.getinfo(name).external_attr >> 16) & 0o111 else 0o644)
                     for name in members)


def stage_vllm(wheel: Path, xz_cache: Path, jobs: int = 2) -> tuple[list[StagedFile], list[dict]]:
    """vLLM's tree (one .tar.xz) and kept kernels (one .xz each) from ``wheel``; what was left out, why."""
    with zipfile.ZipFile(wheel) as zf:
        dist_info = dist_info_name(zf.infolist(), wheel)
        names = sorted(n for n in zf.namelist() if not n.endswith("/"))
        left_out = summarize_left_out(zf, names)
        skipped = {n for n in names if left_out_rule(n)}
        kernels = [n for n in names if n in KEEP_KERNELS]
        missing = sorted(set(KEEP_KERNELS) - set(kernels))
        if missing:
            raise DeviceStageError(f"{wheel.name} lacks kernel(s) {', '.join(missing)}")
        tree = [n for n in names if n not in skipped and n not in kernels
                and (n.startswith("vllm/") or n.startswith(f"{dist_info}/"))]
        log(f"tree: {len(tree)} file(s) of {wheel.name}; {len(kernels)} kernel(s); {len(skipped)} file(s) left out: "
            + ", ".join(f"{d['path']} ({d['files']})" for d in left_out))
        jobs_in: list[tuple[str, str, bytes, str | None]] = [
            ("tree/vllm-tree.tar.xz", "tree", tree_tar(zf, tree), None),
            *((f"kernels/{n}.xz", "kernel", zf.read(n), n) for n in kernels),
        ]

    def one(job: tuple[str, str, bytes, str | None]) -> StagedFile:
        path, kind, data, target = job
        t0 = time.monotonic()
        xz = xz_cached(data, xz_cache)
        size = xz.stat().st_size
        log(f"xz {path}: {len(data) / MIB:.1f} -> {size / MIB:.1f} MiB ({time.monotonic() - t0:.0f} s)")
        return StagedFile(path, kind, xz, size, sha256_file(xz), target,
                          hashlib.sha256(data).hexdigest() if target else None)

    # lzma releases the GIL: the largest first, in parallel.
    order = sorted(jobs_in, key=lambda j: (-len(j[2]), j[0]))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        staged = list(pool.map(one, order))
    return sorted(staged, key=lambda s: s.path), left_out


# --- carries --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """A file, or one part of a file split because it is larger than a carry."""

    path: str  # inside the carry: the file's path, or <path>.part-NN
    file: str  # the staged file's path
    offset: int
    size: int
    part: int | None = None


def split_pieces(files: Sequence[tuple[str, int]], part_size: int) -> list[Piece]:
    """Files as pieces: a file larger than ``part_size`` becomes ``.part-00``, ``.part-01``, ..."""
    pieces = []
    for path, size in files:
        if size <= part_size:
            pieces.append(Piece(path, path, 0, size))
            continue
        count = -(-size // part_size)
        width = max(2, len(str(count - 1)))
        for i in range(count):
            off = i * part_size
            pieces.append(Piece(f"{path}.part-{i:0{width}d}", path, off, min(part_size, size - off), i))
    return pieces


def pack(pieces: Sequence[Piece], capacity: int) -> list[list[Piece]]:
    """First-fit decreasing (size, then path) into bins of ``capacity`` bytes; each bin sorted by path."""
    bins: list[list[Piece]] = []
    room: list[int] = []
    for piece in sorted(pieces, key=lambda p: (-p.size, p.path)):
        if piece.size > capacity:
            raise DeviceStageError(f"{piece.path}: {piece.size} bytes do not fit a carry of {capacity}")
        slot = next((i for i, r in enumerate(room) if r >= piece.size), None)
        if slot is None:
            bins.append([])
            room.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(piece)
        room[slot] -= piece.size
    return [sorted(b, key=lambda p: p.path) for b in bins]


def carry_name(index: int) -> str:
    return f"carry-{index:02d}"


def build_manifest(name: str, files: Sequence[StagedFile], carries: Sequence[Sequence[Piece]],
                   limit: int, extra: Mapping[str, object]) -> dict:
    """The manifest: every file (sha256, size, kind, target, parts), every carry's pieces, and ``extra``."""
    by_path = {f.path: f for f in files}
    sha_of: dict[str, str] = {}
    for pieces in carries:
        for p in pieces:
            sha_of[p.path] = by_path[p.file].sha256 if p.part is None else _piece_sha(by_path[p.file], p)
    parts: dict[str, list[str]] = {}
    for p in sorted((p for c in carries for p in c if p.part is not None), key=lambda p: (p.file, p.part)):
        parts.setdefault(p.file, []).append(p.path)
    return {
        "format": 1,
        "name": name,
        "limit_bytes": limit,
        "files": [
            {"path": f.path, "kind": f.kind, "size": f.size, "sha256": f.sha256,
             **({"target": f.target, "target_sha256": f.target_sha256} if f.target else {}),
             **({"parts": parts[f.path]} if f.path in parts else {})}
            for f in sorted(files, key=lambda f: f.path)
        ],
        "carries": [
            {"name": carry_name(i), "size": sum(p.size for p in pieces),
             "pieces": [{"path": p.path, "file": p.file, "size": p.size, "sha256": sha_of[p.path],
                         **({"part": p.part} if p.part is not None else {})} for p in pieces]}
            for i, pieces in enumerate(carries, 1)
        ],
        **extra,
    }


def _piece_sha(file: StagedFile, piece: Piece) -> str:
    with file.source.open("rb") as fh:
        fh.seek(piece.offset)
        return hashlib.sha256(fh.read(piece.size)).hexdigest()


def write_carries(dest: Path, name: str, files: Sequence[StagedFile], *, limit: int = CARRY_LIMIT,
                  extra: Mapping[str, object] | None = None) -> dict:
    """Pack ``files`` into ``dest/carry-NN/`` (replacing ``dest``) and write the manifests; return it."""
    paths = [f.path for f in files]
    if len(set(paths)) != len(paths):
        raise DeviceStageError("two staged files share a path")
    sized = [(f.path, f.size) for f in sorted(files, key=lambda f: f.path)]
    reserve = min(MANIFEST_RESERVE, limit // 4)
    for _ in range(8):  # the manifest travels in every carry: keep room for it, grow the room if needed
        capacity = limit - reserve
        carries = pack(split_pieces(sized, capacity), capacity)
        manifest = build_manifest(name, files, carries, limit, extra or {})
        text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
        if len(text.encode()) <= reserve:
            break
        reserve = len(text.encode()) * 9 // 8
    else:
        raise DeviceStageError(f"the manifest does not leave room in carries of {limit} bytes")
    by_path = {f.path: f for f in files}
    with replacing_dir(dest) as tmp:
        for i, pieces in enumerate(carries, 1):
            folder = tmp / carry_name(i)
            for piece in pieces:
                out = folder / piece.path
                out.parent.mkdir(parents=True, exist_ok=True)
                _copy_range(by_path[piece.file].source, out, piece.offset, piece.size)
            (folder / "manifest.json").write_text(text)
            total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            if total > limit:
                raise DeviceStageError(f"{carry_name(i)} holds {total} bytes, over the limit {limit}")
        (tmp / "manifest.json").write_text(text)
    return manifest


def _copy_range(src: Path, dst: Path, offset: int, size: int) -> None:
    with src.open("rb") as fin, dst.open("wb") as fout:
        fin.seek(offset)
        left = size
        while left:
            chunk = fin.read(min(left, 8 * MIB))
            if not chunk:
                raise DeviceStageError(f"{src}: shorter than expected")
            fout.write(chunk)
            left -= len(chunk)


def device_calls(manifest: Mapping, dest: Path, command: str = "python3 -m pytest -m gpu tests/patches") -> str:
    """The ``run`` calls that bring every carry to the device, in order, and the command of each."""
    carries = [c["name"] for c in manifest["carries"]]
    lines = [f"device calls ({len(carries)}), back to back: files outside the repository survive on the "
             "device only while it stays warm (30 s between calls)"]
    for i, carry in enumerate(carries, 1):
        tail = f" -- {command}" if i == len(carries) else ""
        lines.append(f"  {i}/{len(carries)}  carry [\"{dest / carry}\"]  "
                     f"command: bash scripts/device-run.sh {dest}{tail}")
    lines.append(f"  then, without carries: bash scripts/device-run.sh {dest} -- COMMAND ...")
    return "\n".join(lines)


def built_wheel(patches_root: Path, vllm: str, dist: Path) -> Path:
    """The wheel ``make build`` writes for the current series of release ``vllm``."""
    from overlay.build import series_tag, wheel_name
    from overlay.pins import load_pin, pin_dir
    from overlay.series import Series

    pin = load_pin(patches_root, vllm)
    tag = series_tag(Series.load(pin_dir(patches_root, vllm)), pin)
    wheel = dist / wheel_name(pin, f"{pin.version}+{tag}")
    if not wheel.is_file():
        raise DeviceStageError(f"{wheel}: not built for the current series; run `make build VLLM={vllm}` first")
    return wheel


# --- the whole run --------------------------------------------------------------------------


@dataclass(frozen=True)
class StageResult:
    dest: Path
    manifest: dict
    seconds: float


def extra_device_requirements(extras: Iterable[str],
                              env: Mapping[str, str] = DEVICE_ENV) -> tuple[list[str], list[str]]:
    """``--extra`` requirements as resolved for the device (marker-free, extras kept), and those left
    out with why (a marker false for the device); the torch family is refused (the device's is used)."""
    kept: list[str] = []
    skipped: list[str] = []
    for line in extras:
        try:
            req = Requirement(line)
        except InvalidRequirement as exc:
            raise DeviceStageError(f"--extra {line!r}: not a requirement ({exc})") from None
        if canonicalize_name(req.name) in TORCH_FAMILY:
            raise DeviceStageError(f"--extra {line!r}: the device's own {req.name} is used, it is never staged")
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            skipped.append(f"{line}: marker false for the device (--extra)")
            continue
        req.marker = None
        if str(req) not in kept:
            kept.append(str(req))
    return kept, skipped


def _cached_resolve(cache: Path, key: str, use_cache: bool, what: str,
                    run: Callable[[], Resolution]) -> tuple[Resolution, bool]:
    """The resolution cached under ``key``, or ``run()``'s (then cached); whether it was cached."""
    cached_file = resolution_cache_file(cache, key)
    resolution = load_resolution(cached_file, key) if use_cache else None
    if resolution is not None:
        log(f"{what}resolution reused from the cache (key {key[:16]}): {cached_file}; "
            "--no-resolution-cache resolves again")
        return resolution, True
    if not use_cache:
        log(f"{what}resolution cache not used (--no-resolution-cache): resolving")
    resolution = run()
    try:
        save_resolution(cached_file, key, resolution)
    except OSError as exc:
        log(f"  warning: resolution not cached ({exc})")
    return resolution, False


def check_no_downgrade(resolution: Resolution, base: Resolution, device: Mapping[str, str]) -> None:
    """Refuse a resolution with extra requirements that stages a device package older than the
    device's, where vLLM's own resolution (``base``) does not already."""
    versions = {w.name: w.version for w in resolution.wheels}
    already = {d.name for d in base.dropped}
    for pin in resolution.dropped:
        staged = versions.get(pin.name)
        if pin.name in already or staged is None:
            continue
        try:
            older = Version(staged) < Version(pin.device_version)
        except InvalidVersion:
            older = staged != pin.device_version
        if older:
            raise DeviceStageError(f"the extra requirements need {pin.name}=={staged}, older than the device's "
                                   f"{pin.device_version} ({pin.reason}); it is not staged over the device's")


def stage(wheel: Path, dest: Path, *, device_packages: Path, name: str, limit: int = CARRY_LIMIT,
          cache: Path | None = None, resolver_python: str | None = None, jobs: int = 2,
          full: bool = False, resolution_cache: bool = True, extras: Sequence[str] = ()) -> StageResult:
    """Resolve, fetch and compress everything, then write the carries and manifest under ``dest``.

    The resolution is cached under ``cache/device-resolutions/<key>.json`` (:func:`resolution_key`);
    ``resolution_cache=False`` resolves again (and refreshes the cached one).

    ``extras`` (``lm-eval[api]==0.4.13``) are resolved with vLLM's requirements into one set, on top
    of vLLM's own resolution (cached as without extras): the device pins that one dropped stay
    dropped, and a device package is never staged in a version older than the device's because of
    them. A package with no wheel for the device gets one built from its sdist, pure Python only
    (:func:`sdist_builder`); otherwise the staging stops naming it.
    """
    start = _CLOCK["start"] = time.monotonic()
    cache = cache or cache_dir()
    if not wheel.is_file():
        raise DeviceStageError(f"{wheel}: no such wheel (make build writes it)")
    version, requires = wheel_requires_dist(wheel)
    not_needed = {} if full else NOT_NEEDED
    requirements, skipped = device_requirements(requires, not_needed=not_needed)
    extra_reqs, extra_skipped = extra_device_requirements(extras)
    skipped += extra_skipped
    device = read_device_packages(device_packages)
    resolver = find_resolver(resolver_python)
    log(f"{wheel.name}: {len(requirements)} requirement(s) for the device, {len(skipped)} left out; "
        f"{len(device)} device package(s); resolver {resolver.description}")
    if extra_reqs:
        log(f"extra requirement(s): {', '.join(extra_reqs)}")
    if not resolver.exact:
        log("  warning: the resolver is not CPython 3.12: dependencies' markers are evaluated for it")
    wheelhouse = cache / "device-wheels" / "from-sdist"

    def resolve_with(extra: Sequence[str], pins: Mapping[str, str]) -> Callable[[], Resolution]:
        def run() -> Resolution:
            with tempfile.TemporaryDirectory(prefix="device-stage-") as work:
                wheelhouse.mkdir(parents=True, exist_ok=True)
                return resolve(requirements, pins, pip_runner(resolver, Path(work), wheelhouse=wheelhouse),
                               build=sdist_builder(resolver, wheelhouse), extra_requirements=extra)
        return run

    base_key = resolution_key(requirements, device, resolver)
    key = resolution_key(requirements, device, resolver, extra_requirements=extra_reqs) if extra_reqs else base_key
    resolution = load_resolution(resolution_cache_file(cache, key), key) if extra_reqs and resolution_cache else None
    cached = resolution is not None
    if resolution is not None:
        log(f"resolution with the extras reused from the cache (key {key[:16]}): {resolution_cache_file(cache, key)}; "
            "--no-resolution-cache resolves again")
    else:
        base, cached = _cached_resolve(cache, base_key, resolution_cache, "", resolve_with((), device))
        if extra_reqs:
            pins = {n: v for n, v in device.items() if canonicalize_name(n) not in {d.name for d in base.dropped}}
            log(f"resolving the extra requirement(s) with vLLM's: {len(base.dropped)} device pin(s) stay dropped")
            resolution, cached = resolve_with(extra_reqs, pins)(), False
            resolution.dropped = sorted([*base.dropped, *resolution.dropped], key=lambda d: d.name)
            resolution.restored = sorted({*base.restored, *resolution.restored})
            resolution.rounds += base.rounds
            check_no_downgrade(resolution, base, device)
            try:
                save_resolution(resolution_cache_file(cache, key), key, resolution)
            except OSError as exc:
                log(f"  warning: resolution not cached ({exc})")
        else:
            resolution = base
    explicit = {_requirement_name(r) for r in extra_reqs}
    not_needed = {k: v for k, v in not_needed.items() if k not in explicit}
    unneeded = [w for w in resolution.wheels if w.name in not_needed]
    resolution.wheels = [w for w in resolution.wheels if w.name not in not_needed]
    skipped += [f"{w.name}=={w.version}: not needed on the device: {not_needed[w.name]}" for w in unneeded]
    log(f"resolved: {len(resolution.wheels)} wheel(s) to stage, {len(resolution.dropped)} device pin(s) dropped"
        f"{f', {len(unneeded)} not needed' if unneeded else ''}")
    staged_wheels = download_wheels(resolution.wheels, cache / "device-wheels", resolver)
    vllm_files, left_out = stage_vllm(wheel, cache / "device-xz", jobs)
    files = [*vllm_files, *staged_wheels]
    sizes = {f.path: f.size for f in staged_wheels}
    extra = {
        "vllm": {"wheel": wheel.name, "version": version, "sha256": sha256_file(wheel)},
        "left_out": left_out,
        "resolution": {
            "target": {"python": "3.12", "implementation": "cp", "platforms": list(PLATFORMS)},
            "resolver": resolver.description,
            "requirements": requirements,
            **({"extra_requirements": extra_reqs} if extra_reqs else {}),
            "not_requested": skipped,
            "device_packages": device_packages.name,
            "dropped_device_pins": [asdict(d) for d in resolution.dropped],
            "restored_device_pins": resolution.restored,
            "rounds": resolution.rounds,
            "cached": cached,
            "cache_key": key,
            **({"built_from_sdist": resolution.built} if resolution.built else {}),
        },
        "wheels": [{"name": w.name, "version": w.version, "file": w.filename, "url": w.url,
                    "sha256": w.sha256, "size": sizes[f"wheels/{w.filename}"],
                    "device_version": device.get(w.name), "required_by": resolution.required_by.get(w.name, [])}
                   for w in resolution.wheels],
    }
    manifest = write_carries(dest, name, files, limit=limit, extra=extra)
    seconds = time.monotonic() - start
    log(f"wrote {len(manifest['carries'])} carries under {dest} ({seconds:.0f} s)")
    return StageResult(dest, manifest, seconds)


def format_summary(manifest: Mapping) -> str:
    """Carries with sizes, the staged wheels, dropped pins: what a person checks before the device."""
    lines = [f"{len(manifest['carries'])} carries, {sum(c['size'] for c in manifest['carries']) / MIB:.1f} MiB"]
    for carry in manifest["carries"]:
        lines.append(f"  {carry['name']}  {carry['size'] / MIB:6.1f} MiB  {len(carry['pieces'])} file(s)")
    wheels = manifest.get("wheels", [])
    lines.append(f"{len(wheels)} wheel(s), {sum(w['size'] for w in wheels) / MIB:.1f} MiB:")
    lines += [f"  {w['name']}=={w['version']}  {w['size'] / MIB:.2f} MiB"
              + (f"  (device has {w['device_version']})" if w.get("device_version") else "")
              + (f"  <- {', '.join(w['required_by'])}" if w.get("required_by") else "") for w in wheels]
    for d in manifest.get("resolution", {}).get("dropped_device_pins", []):
        lines.append(f"dropped device pin {d['name']}=={d['device_version']}: {d['reason']}")
    for pkg, built in sorted(manifest.get("resolution", {}).get("built_from_sdist", {}).items()):
        lines.append(f"built from its sdist (pure Python): {pkg}: {built}")
    return "\n".join(lines)
