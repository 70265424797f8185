"""The whole staging run (``make device-stage``): requirements, resolution (cached), downloads, vLLM's
tree and kernels, carries, and the summary printed."""

from __future__ import annotations

import time
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from overlay.atomic import refuse_link, scratch
from overlay.build.fetch import cache_dir, sha256_file
from overlay.build.pipeline import SeriesWheel
from overlay.build.stand_ins import swap_all
from overlay.device.carries import write_carries
from overlay.device.files import FROM_SDIST, download_wheels, stage_vllm
from overlay.device.requirements import (
    device_requirements,
    read_device_packages,
    read_device_requires,
    wheel_requires_dist,
)
from overlay.device.resolution_cache import load_resolution, resolution_cache_file, resolution_key, save_resolution
from overlay.device.resolve import (
    Resolution,
    Resolver,
    find_resolver,
    pip_runner,
    requirement_name,
    resolve,
    sdist_builder,
)
from overlay.device.settings import (
    CARRY_LIMIT,
    DEVICE_ENV,
    KEEP_KERNELS,
    MIB,
    NOT_NEEDED,
    OPTIONAL_KERNELS,
    PLATFORMS,
    TORCH_FAMILY,
    DeviceStageError,
    log,
    start_clock,
)
from overlay.device.torch_abi import EXPORTS_DIR, TorchCheck
from overlay.device.torch_abi import check as torch_check
from overlay.outpaths import check_dir
from overlay.releases.facts import ReleaseFacts, ReleaseFactsError, release_facts


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


def pinned_torch(requires: Iterable[str]) -> str | None:
    """The torch version vLLM's ``Requires-Dist`` pins exactly (``torch==X``), else None."""
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) == "torch" and req.marker is None:
            exact = [s.version for s in req.specifier if s.operator in ("==", "===")]
            if exact:
                return exact[0]
    return None


def torch_preflight(wheel: Path, version: str, requires: Iterable[str], device: Mapping[str, str],
                    exports_root: Path = EXPORTS_DIR) -> tuple[TorchCheck, dict[str, str]]:
    """The kept kernels of ``wheel`` judged against the device's torch (``overlay.device.torch_abi``):
    a required kernel that cannot load there stops the staging with one line naming it; an optional
    one stays home. Returns the check and the kernels that stay home, with why."""
    with zipfile.ZipFile(wheel) as zf:
        kernels = {n: zf.read(n) for n in zf.namelist() if n in KEEP_KERNELS}
    result = torch_check(version.split("+")[0], pinned_torch(requires), device.get("torch"), kernels, exports_root)
    failing = result.failing()
    if any(k.path not in OPTIONAL_KERNELS for k in failing):
        raise DeviceStageError(result.line())
    home = {k.path: f"{result.why(k)}; {OPTIONAL_KERNELS[k.path]}" for k in failing}
    return result, home


def stage(wheel: Path, dest: Path, *, device_packages: Path, name: str, limit: int = CARRY_LIMIT,
          cache: Path | None = None, resolver_python: str | None = None, jobs: int = 2,
          full: bool = False, resolution_cache: bool = True, extras: Sequence[str] = (),
          beside: Mapping[str, bytes] | None = None, device_requires: Path | None = None) -> StageResult:
    """Resolve, fetch and compress everything, then write the carries and manifest under ``dest``;
    ``beside`` (name -> content: the liveness lines file) travels in every carry next to the manifest.

    The resolution is cached under ``cache/device-resolutions/<key>.json`` (:func:`resolution_key`);
    ``resolution_cache=False`` resolves again (and refreshes the cached one).

    ``extras`` (``lm-eval[api]==0.4.13``) are resolved with vLLM's requirements into one set, on top
    of vLLM's own resolution (cached as without extras): the device pins that one dropped stay
    dropped, and a device package is never staged in a version older than the device's because of
    them. A package with no wheel for the device gets one built from its sdist, pure Python only
    (:func:`sdist_builder`); otherwise the staging stops naming it.
    """
    start = start_clock()
    cache = cache or cache_dir()
    _check_paths(wheel, dest, cache)
    version, requires = wheel_requires_dist(wheel)
    device = read_device_packages(device_packages)
    needs = _device_needs(device_requires, device)
    torch, home = torch_preflight(wheel, version, requires, device)
    log(torch.line(home))
    facts = release_facts_of(wheel)
    log(f"release facts: {facts.summary()}")
    not_needed = {} if full else NOT_NEEDED
    requirements, skipped = device_requirements(requires, not_needed=not_needed)
    requirements, swapped = swap_all(requirements)
    for line in swapped:
        log(f"stand-in: {line}")
    extra_reqs, extra_skipped = extra_device_requirements(extras)
    skipped += extra_skipped
    resolver = find_resolver(resolver_python)
    log(f"{wheel.name}: {len(requirements)} requirement(s) for the device, {len(skipped)} left out; "
        f"{len(device)} device package(s); resolver {resolver.description}")
    if extra_reqs:
        log(f"extra requirement(s): {', '.join(extra_reqs)}")
    if not resolver.exact:
        log("  warning: the resolver is not CPython 3.12: dependencies' markers are evaluated for it")
    resolution, cached, key = _resolution(cache, requirements, extra_reqs, device, resolver, resolution_cache, needs)
    skipped += _leave_out_not_needed(resolution, not_needed, extra_reqs)
    staged_wheels = download_wheels(resolution.wheels, cache / "device-wheels", resolver)
    vllm_files, left_out = stage_vllm(wheel, cache / "device-xz", jobs, home)
    files = [*vllm_files, *staged_wheels]
    sizes = {f.path: f.size for f in staged_wheels}
    extra = {
        "vllm": {"wheel": wheel.name, "version": version, "sha256": sha256_file(wheel)},
        "release_facts": facts.to_dict(),
        "left_out": left_out,
        "torch": torch.to_dict(home),
        "resolution": {
            "target": {"python": "3.12", "implementation": "cp", "platforms": list(PLATFORMS)},
            "resolver": resolver.description,
            "requirements": requirements,
            **({"stand_ins": swapped} if swapped else {}),
            **({"extra_requirements": extra_reqs} if extra_reqs else {}),
            "not_requested": skipped,
            "device_packages": device_packages.name,
            **({"device_requires": device_requires.name} if device_requires is not None else {}),
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
    manifest = write_carries(dest, name, files, limit=limit, extra=extra, beside=beside)
    seconds = time.monotonic() - start
    log(f"wrote {len(manifest['carries'])} carries under {dest} ({seconds:.0f} s)")
    return StageResult(dest, manifest, seconds)


def release_facts_of(wheel: Path) -> ReleaseFacts:
    """The release facts of the wheel's tree (what the engine check on the device picks its cases by): a
    release they cannot describe stops the staging here, in one line, not after a trip to the device."""
    try:
        return release_facts(wheel)
    except ReleaseFactsError as exc:
        raise DeviceStageError(f"device-stage: {exc}") from None


def _check_paths(wheel: Path, dest: Path, cache: Path) -> None:
    """Refuse now, not after resolving, a destination or cache folder that cannot take the staging."""
    check_dir(dest, "--dest")  # a cache folder that is a file must stop the staging now, not after resolving
    refuse_link(dest, DeviceStageError)  # the stage replaces it whole (write_carries)
    for sub in ("device-resolutions", "device-wheels", "device-wheels/from-sdist", "device-xz"):
        check_dir(cache / sub, "device-stage cache folder (VLLM_OVERLAY_CACHE)")
    if not wheel.is_file():
        raise DeviceStageError(f"{wheel}: no such wheel (make build writes it)")


def _device_needs(path: Path | None, device: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """What each device package needs of the others (:func:`read_device_requires`), said in the log;
    none without the device's record (``--device-requires``): the stubs then pin versions only."""
    if path is None:
        log("  warning: no record of the device packages' requirements (scripts/device-requires.py): a package "
            "staged over a device one is not checked against the device packages that need it")
        return {}
    needs, without = read_device_requires(path, device)
    log(f"{path.name}: what {len(needs)} device package(s) need of the others"
        + (f"; {len(without)} without a record at the pinned version: {', '.join(without)}" if without else ""))
    return needs


def _resolution(cache: Path, requirements: list[str], extra_reqs: list[str], device: dict[str, str],
                resolver: Resolver, use_cache: bool,
                needs: Mapping[str, Sequence[str]] | None = None) -> tuple[Resolution, bool, str]:
    """What the device gets: vLLM's requirements resolved against its packages (cached), then the extras
    on top of that, the device pins it dropped staying dropped; with whether it came from the cache and
    its cache key."""
    wheelhouse = cache / "device-wheels" / FROM_SDIST

    def resolve_with(extra: Sequence[str], pins: Mapping[str, str]) -> Callable[[], Resolution]:
        def run() -> Resolution:
            with scratch("device-stage-") as work:
                wheelhouse.mkdir(parents=True, exist_ok=True)
                return resolve(requirements, pins,
                               pip_runner(resolver, Path(work), wheelhouse=wheelhouse, needs=needs),
                               build=sdist_builder(resolver, wheelhouse), extra_requirements=extra)
        return run

    base_key = resolution_key(requirements, device, resolver, needs=needs)
    key = (resolution_key(requirements, device, resolver, extra_requirements=extra_reqs, needs=needs)
           if extra_reqs else base_key)
    resolution = load_resolution(resolution_cache_file(cache, key), key) if extra_reqs and use_cache else None
    if resolution is not None:
        log(f"resolution with the extras reused from the cache (key {key[:16]}): {resolution_cache_file(cache, key)}; "
            "--no-resolution-cache resolves again")
        return resolution, True, key
    base, cached = _cached_resolve(cache, base_key, use_cache, "", resolve_with((), device))
    if not extra_reqs:
        return base, cached, key
    pins = {n: v for n, v in device.items() if canonicalize_name(n) not in {d.name for d in base.dropped}}
    log(f"resolving the extra requirement(s) with vLLM's: {len(base.dropped)} device pin(s) stay dropped")
    resolution = resolve_with(extra_reqs, pins)()
    resolution.dropped = sorted([*base.dropped, *resolution.dropped], key=lambda d: d.name)
    resolution.restored = sorted({*base.restored, *resolution.restored})
    resolution.rounds += base.rounds
    check_no_downgrade(resolution, base, device)
    try:
        save_resolution(resolution_cache_file(cache, key), key, resolution)
    except OSError as exc:
        log(f"  warning: resolution not cached ({exc})")
    return resolution, False, key


def _leave_out_not_needed(resolution: Resolution, not_needed: Mapping[str, str], extra_reqs: list[str]) -> list[str]:
    """Take the wheels the device does not need (but an extra asks for by name) out of ``resolution``;
    one line each for the manifest's ``not_requested``."""
    explicit = {requirement_name(r) for r in extra_reqs}
    not_needed = {k: v for k, v in not_needed.items() if k not in explicit}
    unneeded = [w for w in resolution.wheels if w.name in not_needed]
    resolution.wheels = [w for w in resolution.wheels if w.name not in not_needed]
    log(f"resolved: {len(resolution.wheels)} wheel(s) to stage, {len(resolution.dropped)} device pin(s) dropped"
        f"{f', {len(unneeded)} not needed' if unneeded else ''}")
    return [f"{w.name}=={w.version}: not needed on the device: {not_needed[w.name]}" for w in unneeded]


def format_summary(manifest: Mapping) -> str:
    """Carries with sizes, the staged wheels, dropped pins: what a person checks before the device."""
    lines = [f"{len(manifest['carries'])} carries, {sum(c['size'] for c in manifest['carries']) / MIB:.1f} MiB"]
    if manifest.get("torch", {}).get("line"):
        lines.insert(0, manifest["torch"]["line"])
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
    for file, entry in sorted(manifest.get("beside", {}).items()):
        lines.append(f"beside the manifest in every carry: {file} ({entry['size'] / 1024:.1f} KiB)")
    return "\n".join(lines)


def built_wheel(release: SeriesWheel, dist: Path) -> Path:
    """The wheel ``make build`` writes for the release's current series (it must be built)."""
    wheel = dist / release.filename
    if not wheel.is_file():
        raise DeviceStageError(f"{wheel}: not built for the current series; run `make build "
                               f"VLLM={release.release}` first")
    return wheel
