"""pip resolution for the device's platform: device packages pinned through stub wheels, conflicting
pins dropped with their reason, sdist-only packages built into pure wheels."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from overlay.atomic import child_tmpdir, temp_dir
from overlay.build.wheel import record_hash
from overlay.device.requirements import Conflict, is_stub, parse_conflict, pip_error_tail
from overlay.device.settings import DEVICE_ENV, PLATFORMS, STUB_LABEL, TORCH_FAMILY, DeviceStageError, log
from overlay.errors import shown
from overlay.interrupt import bound_to_parent
from overlay.outpaths import check_name


@dataclass(frozen=True)
class ResolvedWheel:
    """One wheel of pip's resolution that the device lacks."""

    name: str
    version: str
    filename: str
    url: str
    sha256: str | None

    def __post_init__(self) -> None:
        """Its file name is joined into the cache and the stage folder (``device-wheels/<filename>``,
        ``wheels/<filename>`` in a carry): one ``.whl`` name, never a path; a ``ValueError`` says why."""
        try:
            check_name(self.filename)
        except ValueError as exc:
            raise ValueError(f"{self.name}: its file name {shown(self.filename)} is not one name ({exc})") from None
        if not self.filename.endswith(".whl") or self.filename == ".whl":
            raise ValueError(f"{self.name}: its file name {shown(self.filename)} is not a wheel's (*.whl)")
        if not self.url.startswith(("https://", "http://", "file://")):
            raise ValueError(f"{self.name}: its URL {shown(self.url)} is not https://, http:// or file://")
        if self.sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"{self.name}: its sha256 {shown(self.sha256)} is not 64 hex digits")


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
        try:
            wheels.append(ResolvedWheel(canonicalize_name(meta["name"]), meta["version"],
                                        url.rsplit("/", 1)[-1].split("#", 1)[0], url, digest))
        except ValueError as exc:
            raise DeviceStageError(f"pip's resolution: {exc}") from None
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


_VERSIONS = re.compile(r"^ERROR: Could not find a version that satisfies the requirement (\S+) "
                       r"\(from versions: ([^)]*)\)", re.MULTILINE)


def no_such_version(output: str, requirement: str) -> str | None:
    """``requirement`` names a release that does not exist (``lm-eval[api]==99.0``): pip's "from
    versions" (those of its sdists, when it looked for one to build) lists some and none matches."""
    for req, listed in _VERSIONS.findall(output):
        if req != requirement or listed.strip() in ("", "none"):
            continue
        try:
            spec = Requirement(requirement).specifier
            versions = [Version(v.strip()) for v in listed.split(",") if v.strip()]
        except (InvalidRequirement, InvalidVersion):
            return None
        if not any(spec.contains(v, prereleases=True) for v in versions):
            return (f"{requirement}: no such version: none of the {len(versions)} pip finds "
                    f"({min(versions)} to {max(versions)}) matches; ask for one of them")
    return None


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
            name = requirement_name(missing)
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


def requirement_name(text: str) -> str:
    try:
        return canonicalize_name(Requirement(text).name)
    except InvalidRequirement:
        return canonicalize_name(re.split(r"[<>=!~;\[ ]", text, maxsplit=1)[0])


def write_stub_wheel(folder: Path, name: str, version: str, requires: Sequence[str] = ()) -> Path:
    """A metadata-only wheel ``name-<version>+device-py3-none-any.whl`` requiring ``requires`` (what the
    device's package needs of the other device packages), so pip sees when a package the staging
    replaces no longer fits a device package that stays."""
    dist = re.sub(r"[-_.]+", "_", name)
    full = stub_version(version)
    dist_info = f"{dist}-{full}.dist-info"
    needs = "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {full}\n{needs}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: vllm-overlay\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n",
    }
    try:
        path = folder / check_name(f"{dist}-{full}-py3-none-any.whl")
    except ValueError as exc:  # read_device_packages refuses such a name first
        raise DeviceStageError(f"{name}=={version}: not a package name and version for a stub wheel ({exc})") from None
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
        said = proc.stdout.split()
        if proc.returncode != 0 or len(said) != 3:  # not a Python with pip (--resolver-python /bin/echo)
            if cand == explicit:
                raise DeviceStageError(f"--resolver-python {explicit}: not a Python with pip (it "
                                       + (f"exited with {proc.returncode}" if proc.returncode else
                                          f"answered {shown(proc.stdout.strip())} to a Python probe") + ")")
            continue
        impl, pyver, pipver = said
        pip_ok = tuple(int(x) for x in re.findall(r"\d+", pipver)[:2]) >= (22, 2)
        exact = impl == "CPython" and pyver.startswith("3.12.")
        if pip_ok and (exact or cand == explicit or cand == sys.executable):
            return Resolver(cand, f"{impl} {pyver}, pip {pipver}", exact)
    raise DeviceStageError("no Python with pip >= 22.2 found to resolve for the device (--resolver-python)")


def pip_runner(resolver: Resolver, work: Path, platforms: Sequence[str] = PLATFORMS,
               wheelhouse: Path | None = None, needs: Mapping[str, Sequence[str]] | None = None) -> PipRun:
    """A :data:`PipRun` that calls ``pip install --dry-run --report`` with stub wheels for the pins, each
    requiring what ``needs`` records for it (the device's record, :func:`read_device_requires`), and the
    wheels :func:`sdist_builder` built, in ``wheelhouse``, when given."""

    def run(requirements: Sequence[str], pins: Mapping[str, str]) -> PipOutcome:
        with temp_dir(work, "resolve-") as tmp:
            root = Path(tmp)
            stubs = root / "stubs"
            stubs.mkdir()
            for name, version in sorted(pins.items()):
                write_stub_wheel(stubs, name, version, (needs or {}).get(name, ()))
            (root / "requirements.txt").write_text("".join(f"{r}\n" for r in requirements))
            (root / "constraints.txt").write_text(
                "".join(f"{n}=={stub_version(v)}\n" for n, v in sorted(pins.items())))
            cmd = [resolver.python, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                   "--disable-pip-version-check", "--progress-bar", "off",
                   "--report", str(root / "report.json"), "--target", str(root / "target"),
                   *target_args(platforms), "--find-links", str(stubs),
                   *(["--find-links", str(wheelhouse)] if wheelhouse is not None else []),
                   "-c", str(root / "constraints.txt"), "-r", str(root / "requirements.txt")]
            with child_tmpdir() as env:
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False,
                                      env=env, preexec_fn=bound_to_parent())
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
        name = requirement_name(requirement)
        wheelhouse.mkdir(parents=True, exist_ok=True)
        log(f"{name}: no wheel for the device; building one from its sdist ({requirement})")
        with temp_dir(wheelhouse, ".build-") as tmp:
            cmd = [resolver.python, "-m", "pip", "wheel", "--no-deps", "--no-binary", name,
                   "--disable-pip-version-check", "--progress-bar", "off", "-w", tmp, requirement]
            with child_tmpdir({**os.environ, "SOURCE_DATE_EPOCH": SDIST_EPOCH}) as env:
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env,
                                      preexec_fn=bound_to_parent())
            out = proc.stdout + proc.stderr
            got = sorted(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or len(got) != 1:
                if (why := no_such_version(out, requirement)) is not None:
                    raise DeviceStageError(why)  # pip found the package, not the version: nothing was built
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


