"""Get a release's source distribution into the cache, verified, for ``make image``'s kernel stage
and ``make upstream-tests`` (vLLM's own tests).

The sdist lives in ``<cache>/sdists/`` (see :func:`overlay.build.fetch.cache_dir`) and is only moved
there after its sha256 matched ``pin.toml``'s ``sdist_sha256``, through
:func:`overlay.build.fetch.fetch_verified`: a mismatch deletes nothing (the story, told once:
``docs/build/README.md``, "Fetching and verifying a release").

pip cannot fetch vLLM's sdist by name on a machine without a GPU toolchain: preparing its
metadata needs torch and a target device. Nothing here builds it, so :func:`pip_url_download_sdist`
only reads the sdist's URL from a ``pip download -vv`` of the name (which fails at that metadata
step, after naming the URL) and downloads those bytes; the sha256 is what they are trusted by.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path

from overlay.atomic import child_tmpdir, temp_dir
from overlay.build.fetch import cache_dir, fetch_verified
from overlay.build.pins import Pin
from overlay.errors import FetchError, PinError
from overlay.interrupt import bound_to_parent

Downloader = Callable[[str, str, Path], None]
"""``downloader(version, filename, dest_dir)`` puts the sdist ``filename`` into ``dest_dir``."""

def sdist_fields(pin: Pin, source: str) -> tuple[str, str]:
    """``(sdist, sdist_sha256)`` of ``pin``; :class:`PinError` naming ``source`` if either is missing."""
    missing = [k for k, v in (("sdist", pin.sdist), ("sdist_sha256", pin.sdist_sha256)) if not v]
    if missing:
        raise PinError(
            f"{source}: missing field(s) {', '.join(map(repr, missing))}; "
            "the kernel stage builds from the source distribution and needs both"
        )
    assert pin.sdist and pin.sdist_sha256
    return pin.sdist, pin.sdist_sha256


def find_sdist_url(pip_output: str, filename: str) -> str | None:
    """The first ``https://...//<filename>`` in pip's verbose output, without a ``#fragment``."""
    m = re.search(r"https://[^\s\"'#]+/" + re.escape(filename) + r"(?=[\s\"'#)]|$)", pip_output)
    return m[0] if m else None


def _last_line(text: str) -> str:
    """pip's most telling line: a raised exception, else an ``error:`` line, else the last non-hint."""
    lines = [ln.strip(" │╰─>") for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(("hint:", "note:", "See above"))]
    raised = [ln for ln in lines if re.match(r"^\w+(Error|Exception): ", ln)]
    errors = [ln for ln in lines if re.match(r"^(error|ERROR)\b", ln)]
    return (raised or errors or lines or ["no output"])[-1]


def pip_url_download_sdist(version: str, filename: str, dest: Path, *, python: str | None = None) -> None:
    """Let pip find the sdist's URL on the index, then download those bytes as they are.

    Every user of the sdist reads its files (the kernel stage, ``make upstream-tests``,
    ``make patch-lint``); nothing prepares it, so no build requirement of vLLM's is needed. The
    bytes are trusted only through ``sdist_sha256`` (:func:`fetch_sdist` checks it).
    """
    py = python or sys.executable
    with child_tmpdir() as env:
        probe = subprocess.run(
            [py, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
             "-vv", "-d", str(dest), f"vllm=={version}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False, env=env,
            preexec_fn=bound_to_parent(),  # it may download the sdist itself: never on after a kill
        )
    if (dest / filename).is_file():
        return
    url = find_sdist_url(probe.stdout, filename)
    if url is None:
        raise FetchError(
            f"pip download vllm=={version} (sdist) named no {filename} URL: {_last_line(probe.stdout)}"
        )
    part = dest / f".{filename}.part"
    try:
        with urllib.request.urlopen(url, timeout=60) as resp, part.open("wb") as fh:
            while chunk := resp.read(1 << 20):
                fh.write(chunk)
    except OSError as exc:
        raise FetchError(f"download of {url} failed: {exc}") from None
    os.replace(part, dest / filename)


def fetch_sdist(
    pin: Pin, source: str, *, cache: Path | None = None, downloader: Downloader | None = None
) -> Path:
    """Return the verified sdist of ``pin`` from ``<cache>/sdists/``, downloading it if needed."""
    filename, sha256 = sdist_fields(pin, source)
    download = downloader or pip_url_download_sdist
    return fetch_verified((cache or cache_dir()) / "sdists", filename, sha256,
                          lambda dest: download(pin.version, filename, dest),
                          expected_from="the sdist_sha256 in pin.toml")


def _top(sdist: Path, tf: tarfile.TarFile) -> str:
    tops = {m.name.split("/", 1)[0] for m in tf.getmembers()}
    if len(tops) != 1:
        raise FetchError(f"{sdist.name}: expected one top-level folder, found {sorted(tops)[:5]}")
    return tops.pop()


def read_sources(sdist: Path, want: Callable[[str], bool]) -> dict[str, str]:
    """Text of the sdist's members whose path (below the top folder) satisfies ``want``."""
    out: dict[str, str] = {}
    try:
        with tarfile.open(sdist, "r:*") as tf:
            top = _top(sdist, tf)
            for member in tf.getmembers():
                rel = member.name[len(top) + 1:]
                if member.isfile() and rel and want(rel):
                    fh = tf.extractfile(member)
                    assert fh is not None
                    out[rel] = fh.read().decode("utf-8", errors="replace")
    except (tarfile.TarError, EOFError, zlib.error) as exc:  # a cut-short .gz ends in EOFError
        raise FetchError(f"{sdist}: not a readable source archive: {exc}") from None
    return out


def extract_subtree(sdist: Path, prefix: str, dest: Path) -> int:
    """Unpack only the members under ``prefix`` (e.g. ``tests/``, below the top folder) into ``dest``.

    ``dest`` must not exist; the files land in a temporary sibling that is renamed at the end, so
    a half-extracted tree is never left at ``dest``. Returns the number of files written.
    """
    if dest.exists():
        raise FetchError(f"{dest}: exists; the {prefix} tree goes into a fresh folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(sdist, "r:*") as tf:
            top = _top(sdist, tf)
            members = [m for m in tf.getmembers() if m.name.startswith(f"{top}/{prefix}")]
            if not any(m.isfile() for m in members):
                raise FetchError(f"{sdist.name}: holds no {prefix} files")
            with temp_dir(dest.parent, ".extract-") as tmp:
                tf.extractall(tmp, members=members, filter="data")
                os.replace(Path(tmp) / top / prefix.rstrip("/"), dest)
    except (tarfile.TarError, EOFError, zlib.error) as exc:  # a cut-short .gz ends in EOFError
        raise FetchError(f"{sdist}: not a readable source archive: {exc}") from None
    return sum(1 for m in members if m.isfile())


def extract(sdist: Path, dest: Path) -> Path:
    """Unpack ``sdist`` so that its top folder's contents land in ``dest`` (which must be empty)."""
    if dest.exists() and any(dest.iterdir()):
        raise FetchError(f"{dest}: not empty; the kernel source goes into a fresh folder")
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(sdist, "r:*") as tf:
            top = _top(sdist, tf)
            with temp_dir(dest.parent, ".extract-") as tmp:
                tf.extractall(tmp, filter="data")  # refuses absolute paths, links out, devices
                for child in (Path(tmp) / top).iterdir():
                    os.replace(child, dest / child.name)
    except (tarfile.TarError, EOFError, zlib.error) as exc:  # a cut-short .gz ends in EOFError
        raise FetchError(f"{sdist}: not a readable source archive: {exc}") from None
    return dest
