"""The files that go to the device: the resolved wheels downloaded, vLLM's Python tree and its kernels
(xz, cached), and what is left out with the reason."""

from __future__ import annotations

import concurrent.futures
import lzma
import os
import shutil
import subprocess
import time
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from overlay import digest
from overlay.atomic import child_tmpdir, temp_dir, temp_file, umask
from overlay.build.archive import tar_bytes
from overlay.build.fetch import sha256_file
from overlay.build.wheel import dist_info_name
from overlay.device.requirements import pip_error_tail
from overlay.device.resolve import ResolvedWheel, Resolver, target_args
from overlay.device.settings import KEEP_KERNELS, LEFT_OUT, MIB, OPTIONAL_KERNELS, XZ_PRESET, DeviceStageError, log
from overlay.interrupt import bound_to_parent

FROM_SDIST = "from-sdist"  # under the wheel cache: the wheels built from sdists, the only file:// URLs


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
    with temp_dir(target.parent, ".download-") as tmp:  # owned: a killed run's is removed by the next
        got = tmp / wheel.filename
        if wheel.url.startswith("file://"):
            source = Path(wheel.url.removeprefix("file://"))
            built = target.parent / FROM_SDIST
            if built.resolve() not in source.resolve().parents:  # a cached entry naming any file of the machine
                raise DeviceStageError(f"{wheel.filename}: {wheel.url} is not a wheel built from its sdist "
                                       f"(those are in {built}); stage with --no-resolution-cache")
            if not source.is_file():
                raise DeviceStageError(f"{wheel.filename}: {source} (built from its sdist) is gone; "
                                       "stage with --no-resolution-cache to build it again")
            shutil.copyfile(source, got)
        else:
            cmd = [resolver.python, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                   "--progress-bar", "off", *target_args(), "-d", tmp, f"{wheel.name} @ {wheel.url}"]
            with child_tmpdir() as env:
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env,
                                      preexec_fn=bound_to_parent())
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


def left_out_rule(member: str, home: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """Which rule keeps a wheel member home: ``(path or prefix, why)``; None: it travels. ``home``:
    kept kernels that stay home this time (the device's torch cannot load them), with why."""
    for prefix, why in LEFT_OUT:
        if member == prefix or member.startswith(prefix):
            return prefix, why
    if home and member in home:
        return member, home[member]
    if member.endswith(".so") and member not in KEEP_KERNELS:
        return member, OTHER_LIBRARY
    return None


def summarize_left_out(zf: zipfile.ZipFile, members: Iterable[str],
                       home: Mapping[str, str] | None = None) -> list[dict]:
    """One entry per rule that matched: the path or prefix, how many files and bytes, and why."""
    groups: dict[tuple[str, str], list[int]] = {}
    for name in members:
        rule = left_out_rule(name, home)
        if rule:
            groups.setdefault(rule, []).append(zf.getinfo(name).file_size)
    return [{"path": path, "files": len(sizes), "bytes": sum(sizes), "why": why}
            for (path, why), sizes in sorted(groups.items())]


def xz_cached(data: bytes, cache: Path) -> Path:
    """``data`` compressed with xz preset :data:`XZ_PRESET` (CRC64), cached by the sha256 of ``data``."""
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"{digest.of_bytes(data)}.p{XZ_PRESET}.xz"
    if not target.exists():
        with temp_file(cache, ".xz-") as tmp:  # owned: a killed run's is removed by the next
            tmp.write_bytes(lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET))
            os.chmod(tmp, 0o666 & ~umask())
            os.replace(tmp, target)
    return target


def tree_tar(zf: zipfile.ZipFile, members: Sequence[str]) -> bytes:
    """A reproducible tar of ``members``: mode 644 (755 if executable in the wheel)."""
    return tar_bytes((name, zf.read(name), 0o755 if (zf.getinfo(name).external_attr >> 16) & 0o111 else 0o644)
                     for name in members)


def stage_vllm(wheel: Path, xz_cache: Path, jobs: int = 2,
               home: Mapping[str, str] | None = None) -> tuple[list[StagedFile], list[dict]]:
    """vLLM's tree (one .tar.xz) and kept kernels (one .xz each) from ``wheel``; what was left out, why.
    ``home``: optional kernels that stay home (their reason); a required one missing stops it."""
    with zipfile.ZipFile(wheel) as zf:
        dist_info = dist_info_name(zf.infolist(), wheel)
        names = sorted(n for n in zf.namelist() if not n.endswith("/"))
        left_out = summarize_left_out(zf, names, home)
        skipped = {n for n in names if left_out_rule(n, home)}
        kernels = [n for n in names if n in KEEP_KERNELS and n not in skipped]
        missing = sorted(set(KEEP_KERNELS) - set(OPTIONAL_KERNELS) - set(kernels))
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
                          digest.of_bytes(data) if target else None)

    # lzma releases the GIL: the largest first, in parallel.
    order = sorted(jobs_in, key=lambda j: (-len(j[2]), j[0]))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        staged = list(pool.map(one, order))
    return sorted(staged, key=lambda s: s.path), left_out


