"""What the device needs of vLLM's requirements (markers for its Python, its packages left out), and
what pip said when a pin made the resolution impossible."""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from email.parser import BytesParser
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from overlay import jsonfile, textfile
from overlay.build.wheel import dist_info_name
from overlay.device.settings import DEVICE_ENV, STUB_LABEL, TORCH_FAMILY, DeviceStageError
from overlay.errors import one_line, shown

_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")  # a distribution's name (PEP 508)
LINK_RULE = "a device record is read from the repository (or its own folder) only: copy the file itself there"


def read_input(path: Path, what: str, *, limit: int = 1024 * 1024) -> bytes:
    """The bytes of a device record (``--device-packages``, ``--device-requires``): never through a symbolic link out
    of its folder (the first line of a file the person did not write would be quoted), bounded
    (:func:`overlay.jsonfile.read_bytes`: a regular file, at most ``limit`` bytes)."""
    refuse_link_out(path)
    return jsonfile.read_bytes(path, DeviceStageError, what, limit=limit)


def refuse_link_out(path: Path) -> None:
    """Refuse ``path`` reached through a symbolic link out of the repository (the default
    ``scripts/device-packages.txt``, ``scripts/device-requires.json``), or out of its own folder elsewhere."""
    from overlay.outpaths import REPO

    given = Path(os.path.abspath(path))
    textfile.refuse_link_out(path, REPO if REPO in given.parents else given.parent, DeviceStageError, LINK_RULE)


def read_device_packages(path: Path) -> dict[str, str]:
    """``pip freeze`` lines (``name==version``) -> canonical name -> version."""
    packages: dict[str, str] = {}
    raw = read_input(path, "a pip freeze list (name==version lines)")
    text = textfile.decode(raw, str(path), DeviceStageError)  # PowerShell's `>` writes UTF-16
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise DeviceStageError(f"{path}:{lineno}: expected name==version, got {shown(raw)}")
        name, version = name.strip(), version.strip()
        if not _NAME.fullmatch(name):  # it names a stub wheel's file and folder (resolve.write_stub_wheel)
            raise DeviceStageError(f"{path}:{lineno}: {shown(name)} is not a package name (letters, digits, "
                                   "'.', '_' and '-', starting and ending with a letter or digit)")
        try:
            Version(version)
        except InvalidVersion:
            raise DeviceStageError(f"{path}:{lineno}: {shown(name)}: {shown(version)} is not a version") from None
        packages[canonicalize_name(name)] = version
    return packages


def read_device_requires(path: Path, device: Mapping[str, str]) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """What each device package needs of the others, from the device's own record
    (``scripts/device-requires.py``'s JSON): canonical name -> its ``Requires-Dist`` that name a device
    package, markers evaluated for the device (:func:`device_requirements`: extras' lines drop out), for
    the packages recorded at the version ``device`` pins; and one line per package
    left without them (recorded at another version, or not recorded)."""
    what = "a record of scripts/device-requires.py"
    refuse_link_out(path)
    data = jsonfile.read(path, DeviceStageError, what)
    source = str(path)
    recorded: dict[str, tuple[str, list[str]]] = {}
    for n, e in jsonfile.need(data.get("packages"), dict, "packages", source, DeviceStageError, what).items():
        where = f"packages.{n}"
        jsonfile.need(e, dict, where, source, DeviceStageError, what)
        version = jsonfile.need(e.get("version"), str, f"{where}.version", source, DeviceStageError, what)
        requires = jsonfile.need(e.get("requires"), list, f"{where}.requires", source, DeviceStageError, what)
        for i, r in enumerate(requires):
            jsonfile.need(r, str, f"{where}.requires[{i}]", source, DeviceStageError, what)
        recorded[canonicalize_name(n)] = (version, list(requires))
    names = {canonicalize_name(n) for n in device}
    needs: dict[str, tuple[str, ...]] = {}
    without: list[str] = []
    for name, version in sorted((canonicalize_name(n), v) for n, v in device.items()):
        found = recorded.get(name)
        if found is None or found[0] != version:
            without.append(f"{name}=={version}: " + (f"recorded at {found[0]}" if found else "not recorded"))
            continue
        kept: list[str] = []
        for line in found[1]:
            try:  # markers as the device has them: lines only an extra asks for drop out
                kept += device_requirements([line], exclude=frozenset())[0]
            except InvalidRequirement as exc:
                raise DeviceStageError(f"{path}: {name}: {shown(line)}: not a requirement ({exc})") from None
        needs[name] = tuple(r for r in kept if canonicalize_name(Requirement(r).name) in names)
    return needs, without


def wheel_requires_dist(wheel: Path) -> tuple[str, list[str]]:
    """The wheel's version and its ``Requires-Dist`` lines, as METADATA has them, each a requirement (else one line
    naming the wheel and the line)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            dist_info = dist_info_name(zf.infolist(), wheel)
            meta = BytesParser().parsebytes(zf.read(f"{dist_info}/METADATA"))
    except (zipfile.BadZipFile, KeyError) as exc:
        raise DeviceStageError(f"{wheel}: not a wheel with a METADATA ({one_line(str(exc))})") from None
    requires = [str(line) for line in meta.get_all("Requires-Dist") or []]
    for line in requires:
        try:
            Requirement(line)
        except InvalidRequirement as exc:
            raise DeviceStageError(f"{wheel}: METADATA: Requires-Dist {shown(line)}: not a requirement "
                                   f"({one_line(str(exc).splitlines()[0])})") from None
    return str(meta["Version"]), requires


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
    """pip's "The conflict is caused by:" block: the device pins it names, and its lines. A device pin is
    named as a constraint (``The user requested (constraint) hub==1.33.0+device``) or as a stub whose
    recorded needs no longer fit (``transformers 5.17.0+device depends on huggingface-hub<2.0``)."""

    constraints: tuple[str, ...]  # canonical names, in the order pip printed them
    lines: tuple[str, ...]

    def reason(self, name: str) -> str:
        """The block's lines about ``name`` (all of them if none names it), for the log."""
        about = list(dict.fromkeys(line for line in self.lines
                                   if name in (_required_name(line), _stub_dependent(line))))
        about = about or list(dict.fromkeys(self.lines))
        more = f"; ... ({len(about) - 4} more)" if len(about) > 4 else ""
        return ("; ".join(about[:4]) + more).replace("The user requested ", "vllm requires ")


_CONSTRAINT = re.compile(r"^The user requested \(constraint\) ([A-Za-z0-9][A-Za-z0-9._-]*)")
_REQUIRED = re.compile(r"(?:depends on|The user requested) ([A-Za-z0-9][A-Za-z0-9._-]*)")


_DEPENDENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*) (\S+) depends on ")


def is_stub(version: str) -> bool:
    """``version`` is a stub's: the device's version with the local label ``device``."""
    try:
        local = Version(version).local
    except InvalidVersion:
        return False
    return local is not None and local.split(".")[-1] == STUB_LABEL


def _stub_dependent(line: str) -> str | None:
    """The device package whose stub (``<version>+device``) makes the requirement of ``line``."""
    found = _DEPENDENT.match(line)
    return canonicalize_name(found[1]) if found and is_stub(found[2]) else None


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
    pins += [name for name in map(_stub_dependent, block) if name]
    others = tuple(line for line in block if not _CONSTRAINT.match(line))
    return Conflict(tuple(dict.fromkeys(pins)), others)


def pip_error_tail(output: str, lines: int = 3) -> str:
    """The last ``ERROR:`` lines pip printed (or its last lines), one string."""
    errors = [line.strip() for line in output.splitlines() if line.startswith("ERROR:")]
    tail = errors or [line.strip() for line in output.splitlines() if line.strip()]
    return " | ".join(tail[-lines:]) or "no output"


