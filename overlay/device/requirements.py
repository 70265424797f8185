"""What the device needs of vLLM's requirements (markers for its Python, its packages left out), and
what pip said when a pin made the resolution impossible."""

from __future__ import annotations

import re
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from email.parser import BytesParser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from overlay import textfile
from overlay.build.wheel import dist_info_name
from overlay.device.settings import DEVICE_ENV, TORCH_FAMILY, DeviceStageError
from overlay.errors import shown


def read_device_packages(path: Path) -> dict[str, str]:
    """``pip freeze`` lines (``name==version``) -> canonical name -> version."""
    packages: dict[str, str] = {}
    text = textfile.decode(path.read_bytes(), str(path), DeviceStageError)  # PowerShell's `>` writes UTF-16
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise DeviceStageError(f"{path}:{lineno}: expected name==version, got {shown(raw)}")
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


