"""Get a release's wheel through pip into the cache outside the repo, and verify it.

The cache lives in ``$VLLM_OVERLAY_CACHE`` (default ``~/.cache/vllm-overlay``). A file is
only ever moved into the cache after its sha256 matched the pin. A digest mismatch never
destroys a file: a cached file that does not match is left where it is and reported, a
mismatching download is kept aside in ``<cache>/quarantine/<folder>/<its sha256>/`` and
reported, and neither is downloaded again until the pin is fixed or the file deleted (a kept
download that matches the fixed pin is taken without a download).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from overlay import digest
from overlay.atomic import child_tmpdir, scratch, sweep, temp_dir
from overlay.build.pins import Pin
from overlay.errors import FetchError, OverlayError
from overlay.interrupt import bound_to_parent
from overlay.outpaths import check_own_folder

DOWNLOAD_PREFIX = ".download-"
"""A cache folder's temporaries (:func:`overlay.atomic.temp_dir`): ``.download-<host>-<pid>-<random>``."""

Downloader = Callable[[str, Path], None]
"""``downloader(requirement, dest_dir)`` puts the release file into ``dest_dir``."""

# The pinned wheel is manylinux x86_64 whatever machine builds the overlay. Each pin.toml's wheel must be
# one pip picks for this target (its platform tag, a CPython 3.11 tag): tests/test_fetch.py holds every pin
# under patches/ and tests/pins/ to the command pip is given.
_PIP_TARGET = ["--platform", "manylinux_2_28_x86_64", "--implementation", "cp", "--python-version", "3.11"]


CACHE_DEFAULT = "~/.cache/vllm-overlay"
CACHE_HOLDS = "wheels/, sdists/, deps/, trees/ and more"  # what every cache user puts into the root


def cache_dir() -> Path:
    """Root of the download cache: ``$VLLM_OVERLAY_CACHE``, else ``~/.cache/vllm-overlay``; never the
    repository, inside it or above it, nor the home folder itself (:func:`overlay.outpaths.check_own_folder`:
    a :class:`~overlay.outpaths.OutPathError` line naming the variable)."""
    root = os.environ.get("VLLM_OVERLAY_CACHE")
    if root:
        return check_own_folder(root, "VLLM_OVERLAY_CACHE", holds=CACHE_HOLDS, default=CACHE_DEFAULT)
    return check_own_folder(Path.home() / ".cache" / "vllm-overlay", "the default cache (VLLM_OVERLAY_CACHE unset)",
                            holds=CACHE_HOLDS, default=CACHE_DEFAULT)


CACHE_MARK = "<cache>"  # a recorded path under the cache root: ``<cache>/deps/0.34.0-62340614bfc3``
ELSEWHERE_MARK = "<elsewhere>"  # a recorded path under neither root: only its last part (``<elsewhere>/site``)
REPO_ROOT = Path(__file__).resolve().parents[2]


def recorded_path(path: str | Path, cache: Path | None = None, repo: Path = REPO_ROOT) -> str:
    """``path`` as a record the tools write carries it: relative to the repository (``docs/records/...``),
    under the cache as ``<cache>/...``, anywhere else as ``<elsewhere>/<its name>``; never a machine's absolute
    path (the same run on another machine, or another user's cache, writes the same record). A relative
    path and "" stay as they are; ``cache`` defaults to :func:`cache_dir` (an unusable cache setting: none)."""
    if not str(path) or not Path(path).is_absolute():
        return str(path)
    where = Path(os.path.abspath(path))
    if cache is None:
        try:
            cache = cache_dir()
        except OverlayError:
            cache = None
    roots = [(cache, CACHE_MARK)] if cache is not None else []
    for root, mark in sorted([*roots, (repo, "")], key=lambda r: -len(str(r[0]))):  # the deeper root first
        root = Path(os.path.abspath(root))
        if where == root or root in where.parents:
            rel = "" if where == root else where.relative_to(root).as_posix()
            return f"{mark}/{rel}".rstrip("/") if mark else (rel or ".")
    return f"{ELSEWHERE_MARK}/{where.name}"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed (:func:`overlay.digest.of_file`)."""
    return digest.of_file(path)


def pip_download_wheel(requirement: str, dest: Path) -> None:
    """Download one binary wheel with pip (no dependencies), showing pip's progress on a tty."""
    quiet = not sys.stderr.isatty()
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", *_PIP_TARGET,
        "--progress-bar", "off" if quiet else "on",
        "-d", str(dest), requirement,
    ]
    if quiet:
        cmd.insert(4, "-q")
    with child_tmpdir() as env:  # pip's own pip-unpack-* lives in a folder the next run sweeps
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE if quiet else None,
            stderr=subprocess.PIPE if quiet else None, check=False, env=env,
            preexec_fn=bound_to_parent(),  # a SIGKILLed build leaves no pip writing on into the cache
        )
    if proc.returncode != 0:
        err = (proc.stderr or b"").decode(errors="replace").strip().splitlines()
        raise FetchError(
            f"pip download {requirement} failed ({proc.returncode})"
            + (f": {err[-1]}" if err else "")
        )


def verify(path: Path, expected: str, *, name: str | Path | None = None,
           fix: str | Callable[[str], str] = "") -> None:
    """Raise :class:`FetchError` if ``path`` does not hash to ``expected``: the one compare-and-raise step.

    The line names the file (``name``, default ``path``), both digests and, after ``; ``, the fix
    (``fix``, or ``fix(actual)`` for a fix that depends on the file's digest, e.g. where a
    mismatching download was kept). Every digest check of a base file goes through here: the cache,
    a fresh download, a file copied in, and ``build --base-wheel``.
    """
    actual = sha256_file(path)
    if actual == expected:
        return
    advice = fix(actual) if callable(fix) else fix
    raise FetchError(f"{name if name is not None else path}: sha256 mismatch: expected {expected}, got {actual}"
                     + (f"; {advice}" if advice else ""))


def fetch_verified(
    folder: Path, filename: str, sha256: str, download: Callable[[Path], None], *,
    expected_from: str = "the sha256 in pin.toml",
) -> Path:
    """Return ``folder/filename`` once it hashes to ``sha256``, downloading it if needed.

    ``download(dest_dir)`` puts the file into a temporary folder beside the cache entry; it
    is moved into place only after it verified. No mismatching file is deleted or downloaded
    again (see the module docstring); the error names the file, both digests and the fix.
    ``expected_from`` says where ``sha256`` comes from, for that message.
    """
    target = folder / filename
    sweep(folder, DOWNLOAD_PREFIX)  # what a killed fetch left (its pip child died with it)
    if target.exists():
        verify(target, sha256, fix=f"the file is kept: if {expected_from} is wrong, fix it; if the file is "
                                   "damaged, delete it to download it again")
        return target
    if _take_quarantined(folder, filename, sha256):
        return target
    _refuse_quarantined(folder, filename, sha256, expected_from)
    folder.mkdir(parents=True, exist_ok=True)
    with temp_dir(folder, DOWNLOAD_PREFIX) as tmpdir:  # owned: a killed run's is removed by the next
        print(f"fetching {filename} ...", file=sys.stderr)
        download(tmpdir)
        got = tmpdir / filename
        if not got.is_file():
            names = sorted(p.name for p in tmpdir.iterdir())
            raise FetchError(f"pip did not produce {filename} (got {names or 'nothing'})")

        def keep(actual: str) -> str:
            kept = _quarantine(got, folder, actual)
            return (f"the download is kept as {kept}: if {expected_from} is wrong, fix it (the next build takes "
                    f"the kept file); if the download is damaged, delete {kept} to download it again")

        verify(got, sha256, name=filename, fix=keep)
        os.replace(got, target)
    return target


def quarantine_dir(folder: Path) -> Path:
    """Where mismatching downloads of cache ``folder`` are kept: ``<cache>/quarantine/<folder name>/``."""
    return folder.parent / "quarantine" / folder.name


def _quarantine(path: Path, folder: Path, actual: str) -> Path:
    kept = quarantine_dir(folder) / actual / path.name
    kept.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, kept)
    return kept


def _take_quarantined(folder: Path, filename: str, sha256: str) -> bool:
    """Move a kept download that hashes to ``sha256`` (the pin was fixed) into the cache."""
    kept = quarantine_dir(folder) / sha256 / filename
    if not kept.is_file() or sha256_file(kept) != sha256:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    os.replace(kept, folder / filename)
    with contextlib.suppress(OSError):
        kept.parent.rmdir()
    return True


def _refuse_quarantined(folder: Path, filename: str, sha256: str, expected_from: str) -> None:
    """One error instead of a download that would only mismatch again."""
    for kept in sorted(quarantine_dir(folder).glob(f"*/{filename}")):
        raise FetchError(f"{kept}: sha256 mismatch: expected {sha256}, got {kept.parent.name} (downloaded "
                         f"before and kept; not downloading it again): if {expected_from} is wrong, fix it; "
                         f"if the download is damaged, delete {kept} to download it again")


def fetch_wheel(pin: Pin, *, cache: Path | None = None, downloader: Downloader | None = None,
                expected_from: str = "the sha256 in pin.toml") -> Path:
    """Return the verified base wheel of ``pin`` from the cache, downloading it if needed."""
    download = downloader or pip_download_wheel
    return fetch_verified((cache or cache_dir()) / "wheels", pin.wheel, pin.sha256,
                          lambda dest: download(f"vllm=={pin.version}", dest), expected_from=expected_from)


def copy_into_cache(src: Path, folder: Path, sha256: str) -> Path:
    """Copy an already downloaded file into a cache folder after verifying it (offline use)."""
    verify(src, sha256, name=src.name)
    target = folder / src.name
    with temp_dir(folder, DOWNLOAD_PREFIX) as tmp:
        shutil.copyfile(src, tmp / src.name)
        os.replace(tmp / src.name, target)
    return target


IndexDigest = Callable[[str], tuple[str, str]]
"""``lookup(requirement)`` returns ``(wheel file name, sha256)`` as the package index publishes it."""


def pip_index_digest(requirement: str) -> tuple[str, str]:
    """The wheel pip would pick for ``requirement`` and the sha256 the index publishes for it.

    ``pip install --dry-run --report`` resolves the requirement against the index without
    downloading the wheel (PyPI serves the metadata separately) and reports the link it chose
    with the digest from the index's own page (``download_info.archive_info.hashes``). That
    digest, not one computed here, is what a download is checked against.
    """
    with scratch("overlay-report-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
            "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", *_PIP_TARGET,
            "--target", str(Path(tmp) / "target"),  # required by --platform; nothing is installed
            "--report", str(report), requirement,
        ]
        with child_tmpdir() as env:
            proc = subprocess.run(cmd, capture_output=True, check=False, env=env, preexec_fn=bound_to_parent())
        if proc.returncode != 0 or not report.exists():
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            raise FetchError(
                f"pip could not resolve {requirement} on the index ({proc.returncode})"
                + (f": {err[-1]}" if err else "")
            )
        data = json.loads(report.read_text())
    items = data.get("install") or []
    if len(items) != 1:
        raise FetchError(f"pip resolved {requirement} to {len(items)} files, expected one wheel")
    info = items[0].get("download_info") or {}
    url = str(info.get("url", ""))
    sha = ((info.get("archive_info") or {}).get("hashes") or {}).get("sha256")
    name = url.rsplit("/", 1)[-1].split("#", 1)[0]
    if not name.endswith(".whl"):
        raise FetchError(f"pip resolved {requirement} to {url!r}, not a wheel")
    if not sha:
        raise FetchError(f"the index publishes no sha256 for {name}; refusing to trust it")
    return name, sha


def fetch_release(
    version: str,
    *,
    cache: Path | None = None,
    downloader: Downloader | None = None,
    index_digest: IndexDigest | None = None,
) -> tuple[Pin, Path]:
    """Fetch the wheel of a release that has no ``pin.toml`` yet and return a pin for it.

    Trust comes from the package index: ``index_digest`` (default :func:`pip_index_digest`)
    gives the file name and the sha256 the index publishes; the downloaded file (pip checks
    it against that digest as it downloads) is hashed here again and must match before it
    enters the cache. A wheel already in ``<cache>/wheels/`` or ``<cache>/wheels-unpinned/``
    (a manual ``pip download``) is reused only when it hashes to the published digest.
    """
    cache = cache or cache_dir()
    name, sha = (index_digest or pip_index_digest)(f"vllm=={version}")
    pin = Pin.from_dict({"version": version, "wheel": name, "sha256": sha}, f"index entry for vllm {version}")
    unpinned = cache / "wheels-unpinned" / name
    if unpinned.exists() and not (cache / "wheels" / name).exists():
        try:
            copy_into_cache(unpinned, cache / "wheels", sha)
        except FetchError:
            pass  # not the published file: fetch_wheel downloads it
    wheel = fetch_wheel(pin, cache=cache, downloader=downloader,
                        expected_from="the sha256 the package index publishes")
    from overlay.build.install import torch_pin

    try:  # the wheel's own torch pin, written into the new pin.toml; a wheel whose metadata cannot say leaves it
        torch = torch_pin(wheel)  # out, and the build names the missing field
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        torch = None
    return dataclasses.replace(pin, torch=torch), wheel
