"""``make build``: official wheel + patch series -> patched, versioned wheel in ``dist/``.

Coordinates the other modules: pin -> fetch -> series -> apply -> rewrite wheel. The wheel
is written into ``dist/`` by :mod:`overlay.build.distdir`: one build at a time, under a temporary name
renamed at the very end, so a failed or killed build leaves the previous wheel untouched.
"""

from __future__ import annotations

import json
import re
import time
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from overlay import __version__ as TOOL_VERSION
from overlay import digest
from overlay.build.apply import apply_series, wheel_reader
from overlay.build.distdir import write_into
from overlay.build.fetch import fetch_wheel, verify
from overlay.build.install import check_torch_pin
from overlay.build.pins import Pin, load_pin, pin_dir
from overlay.build.series import Series
from overlay.build.wheel import rewrite_wheel
from overlay.errors import KernelPatchError, WheelError

OVERLAY_JSON = "vllm/_overlay.json"
VERSION_PY = "vllm/_version.py"
TAG_PREFIX = "ovl"


@dataclass(frozen=True)
class BuildResult:
    """What a build produced."""

    wheel: Path
    version: str
    tag: str
    patches: int
    seconds: float


def series_tag(series: Series, pin: Pin) -> str:
    """Local version label from the series content: same series and base, same tag."""
    return TAG_PREFIX + series.digest(pin.sha256)[:10]


def overlay_manifest(series: Series, pin: Pin, version: str, kernels: dict[str, bytes] | None = None) -> bytes:
    """``vllm/_overlay.json``: what this wheel is made of (with rebuilt kernels: each library's path,
    CMake target and sha256, and the kernel patches it was built with). No timestamps."""
    doc = {
        "base": {"version": pin.version, "wheel": pin.wheel, "sha256": pin.sha256},
        "version": version,
        "patches": [
            {
                "name": p.name,
                "sha256": p.sha256,
                "subject": p.subject,
                "origin": p.origin,
                "kind": p.kind,
            }
            for p in series.patches
        ],
        "tool": {"name": "vllm-overlay", "version": TOOL_VERSION},
    }
    if kernels:
        doc["kernels"] = {
            "patches": [p.name for p in series.kernel_patches],
            "rebuilt": [
                {"path": path, "target": path.rsplit("/", 1)[-1].split(".", 1)[0], "sha256": digest.of_bytes(data)}
                for path, data in sorted(kernels.items())
            ],
        }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def patch_version_py(text: bytes, version: str) -> bytes:
    """Set ``__version__`` and ``__version_tuple__`` in vLLM's generated ``_version.py``."""
    src = text.decode()
    base, _, local = version.partition("+")
    parts: list[int | str] = [int(x) if x.isdigit() else x for x in base.split(".")]
    if local:
        parts.append(local)
    src, n1 = re.subn(r"^__version__ = version = .*$", f"__version__ = version = {version!r}", src,
                      count=1, flags=re.M)
    src, n2 = re.subn(r"^__version_tuple__ = version_tuple = .*$",
                      f"__version_tuple__ = version_tuple = {tuple(parts)!r}", src, count=1, flags=re.M)
    if n1 != 1 or n2 != 1:
        raise WheelError(f"{VERSION_PY}: no '__version__ = version = ...' / version_tuple line to update")
    return src.encode()


def wheel_name(pin: Pin, version: str) -> str:
    """The base wheel's file name with the version replaced."""
    prefix = f"vllm-{pin.version}-"
    return f"vllm-{version}-" + pin.wheel[len(prefix):]


@dataclass(frozen=True)
class SeriesWheel:
    """A carried release as the tools hand it down, loaded once at the front door (:func:`series_wheel`): its
    pin, series, and the wheel they give (local version and file name)."""

    pin: Pin
    series: Series
    tag: str

    @property
    def release(self) -> str:
        return self.pin.version

    @property
    def version(self) -> str:
        return f"{self.pin.version}+{self.tag}"

    @property
    def filename(self) -> str:
        return wheel_name(self.pin, self.version)


def series_wheel(patches_root: Path, version: str) -> SeriesWheel:
    """The wheel ``make build`` writes for release ``version``'s series (the build, the image plan and
    the device staging all name it through this); a series without a patch is refused."""
    pin = load_pin(patches_root, version)
    series = Series.load(pin_dir(patches_root, version)).require_patches(
        f"its wheel would be vLLM {version} unpatched under an overlay version (for that, install vllm=={version})")
    return SeriesWheel(pin, series, series_tag(series, pin))


def build(
    patches_root: Path,
    version: str,
    dist: Path,
    *,
    base_wheel: Path | None = None,
    kernels: dict[str, Path] | None = None,
) -> BuildResult:
    """Build the patched wheel for release ``version`` into ``dist``.

    ``base_wheel`` skips the fetch: a wheel at hand, verified against ``pin.toml`` like a downloaded
    one before anything reads it (``wheel.py`` trusts its RECORD on that). ``kernels`` maps
    archive paths (``vllm/_C.abi3.so``) to rebuilt binaries from ``make image``'s kernel
    stage; without them a series with kernel patches is refused.
    """
    start = time.perf_counter()
    target_wheel = series_wheel(patches_root, version)
    pin, series = target_wheel.pin, target_wheel.series
    if series.kernel_patches and not kernels:
        names = ", ".join(p.name for p in series.kernel_patches)
        raise KernelPatchError(
            f"patch {names} touches compiled sources ({series.kernel_patches[0].touched[0]}); "
            "the overlay cannot change prebuilt kernels: use `make image`, which rebuilds them"
        )
    wheel = _check_base(base_wheel, pin) or fetch_wheel(pin)
    tag, full_version = target_wheel.tag, target_wheel.version
    with _readable(wheel, given=base_wheel is not None), zipfile.ZipFile(wheel) as zf:
        check_torch_pin(pin.torch, wheel, str(pin_dir(patches_root, version) / "pin.toml"))
        read = wheel_reader(zf)
        # Kernel patches may carry Python changes too: those are overlaid; their compiled
        # sources were built into ``kernels`` by make image's kernel stage.
        applied = apply_series(series.patches, read, label=f"vllm {pin.version}", skip_kernel_files=True)
        version_py = read(VERSION_PY)
        if version_py is None:
            raise WheelError(f"{wheel.name}: has no {VERSION_PY}")
        changed = dict(applied.changed)
        changed[VERSION_PY] = patch_version_py(changed.get(VERSION_PY, version_py), full_version)
        rebuilt: dict[str, bytes] = {}
        for archive_path, binary in sorted((kernels or {}).items()):
            if archive_path not in zf.namelist():
                raise WheelError(f"{binary}: {archive_path!r} is not a library of {wheel.name}; "
                                 "rebuilt kernels must replace existing ones")
            rebuilt[archive_path] = binary.read_bytes()
        changed.update(rebuilt)
        changed[OVERLAY_JSON] = overlay_manifest(series, pin, full_version, rebuilt)
        target = write_into(dist, target_wheel.filename, lambda tmp: rewrite_wheel(
            wheel, tmp, package="vllm", version=full_version, changed=changed,
            deleted=frozenset(applied.deleted), source=zf))
    elapsed = time.perf_counter() - start
    return BuildResult(target, full_version, tag, len(series.patches), elapsed)


def _check_base(base_wheel: Path | None, pin: Pin) -> Path | None:
    """``base_wheel`` once it is a file that hashes to the pin's sha256 (as :func:`fetch_wheel` checks a
    cached or downloaded one); ``None`` when there is none (fetch it)."""
    if base_wheel is None:
        return None
    if not base_wheel.is_file():
        raise WheelError(f"{base_wheel}: no such file: pass a complete wheel with --base-wheel")
    try:
        verify(base_wheel, pin.sha256, fix=f"it is not the {pin.wheel} that pin.toml pins: pass that wheel with "
                                           "--base-wheel (or leave --base-wheel out to fetch it)")
    except OSError as exc:
        raise WheelError(f"{base_wheel}: cannot read it ({exc.strerror or exc}): pass a readable wheel with "
                         "--base-wheel") from None
    return base_wheel


@contextmanager
def _readable(wheel: Path, *, given: bool) -> Iterator[None]:
    """Turn a damaged base wheel (not a zip, truncated, a corrupt member) into one line."""
    try:
        yield
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        fix = "pass a complete wheel with --base-wheel" if given else "delete it to download it again"
        raise WheelError(f"{wheel}: not a readable wheel ({exc}): {fix}") from exc
