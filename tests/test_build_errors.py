"""``overlay build`` failures as one ``error:`` line (no traceback), and the mode of the wheel it writes."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import overlay.build.wheel
from overlay.build.pipeline import build
from overlay.cli import main
from tests.wheelkit import sha256


@pytest.fixture
def release(one_patch_release: tuple[Path, Path]) -> tuple[Path, Path]:
    return one_patch_release


def _cli_build(capsys: pytest.CaptureFixture[str], root: Path, dist: Path, wheel: Path) -> str:
    """Run ``overlay build``; assert exit 1 with one ``error:`` line and no traceback; return the line."""
    rc = main(["--patches", str(root), "build", "--dist", str(dist), "--base-wheel", str(wheel)])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith("error: ")
    return line


def _files(dist: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in dist.iterdir() if p.name != ".overlay-build.lock"}


@pytest.fixture
def previous(release: tuple[Path, Path], tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A ``dist/`` holding the wheel of an earlier, successful build (the same name a new build writes)."""
    root, wheel = release
    dist = tmp_path / "dist"
    build(root, "0.28.0", dist, base_wheel=wheel)
    return dist, _files(dist)


def test_disk_full_is_one_line_and_keeps_the_previous_wheel(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, release: tuple[Path, Path],
    previous: tuple[Path, dict[str, bytes]],
) -> None:
    root, wheel = release
    dist, before = previous

    def full(self: object, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(overlay.build.wheel._Writer, "_write", full)
    line = _cli_build(capsys, root, dist, wheel)
    assert line.startswith(f"error: {dist}/vllm-0.28.0+ovl")
    assert f"cannot write the wheel: No space left on device: free space on the filesystem of {dist}" in line
    assert _files(dist) == before  # the previous wheel is untouched, no temporary file is left


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A folder nobody can create files in: mode 0o500, or (as root, whom modes do not stop) immutable."""
    dist = tmp_path / "ro"
    dist.mkdir()
    if os.geteuid() != 0:
        dist.chmod(0o500)
        yield dist
        dist.chmod(0o700)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(dist)], capture_output=True).returncode != 0:
        pytest.skip("running as root, where mode 0o500 does not stop writes, and chattr +i is not available")
    try:
        yield dist
    finally:
        subprocess.run([chattr, "-i", str(dist)], check=True)


def test_dist_not_writable_is_one_line(capsys: pytest.CaptureFixture[str], release: tuple[Path, Path],
                                       read_only: Path) -> None:
    root, wheel = release
    line = _cli_build(capsys, root, read_only, wheel)
    assert line.startswith(f"error: {read_only}: cannot write into it (")
    assert line.endswith(f"): make it writable (chmod u+w {read_only}) or build into another folder (--dist)")
    assert list(read_only.iterdir()) == []


def test_dist_that_is_a_file_is_one_line(capsys: pytest.CaptureFixture[str], release: tuple[Path, Path],
                                         tmp_path: Path) -> None:
    root, wheel = release
    dist = tmp_path / "dist"
    dist.write_bytes(b"not a folder")
    line = _cli_build(capsys, root, dist, wheel)
    assert line == f"error: {dist}: is a file, not a folder: move it away or build into another folder (--dist)"
    assert dist.read_bytes() == b"not a folder"


def _damage_member(data: bytes) -> bytes:
    """Flip bytes inside the compressed data of ``vllm/a.py`` (a member the build decompresses)."""
    at = data.index(b"vllm/a.py") + len("vllm/a.py") + 4
    return data[:at] + bytes(b ^ 0xFF for b in data[at:at + 16]) + data[at + 16:]


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        pytest.param(lambda data: b"this is not a zip file\n" * 10, "File is not a zip file", id="not-a-zip"),
        pytest.param(lambda data: data[: len(data) // 2], "File is not a zip file", id="truncated"),
        pytest.param(_damage_member, "", id="damaged-member"),
        pytest.param(None, "no such file", id="missing"),
    ],
)
def test_corrupt_base_wheel_is_one_line_and_keeps_the_previous_wheel(
    capsys: pytest.CaptureFixture[str], release: tuple[Path, Path], previous: tuple[Path, dict[str, bytes]],
    tmp_path: Path, corrupt, reason: str,
) -> None:
    root, wheel = release
    dist, before = previous
    bad = tmp_path / "bad" / wheel.name
    bad.parent.mkdir()
    if corrupt is not None:
        bad.write_bytes(corrupt(wheel.read_bytes()))
        _repin(root, bad)  # pin.toml records the damaged file: the digest passes, the reading must not
    line = _cli_build(capsys, root, dist, bad)
    assert line.startswith(f"error: {bad}: ")
    assert reason in line
    assert line.endswith("pass a complete wheel with --base-wheel")
    assert _files(dist) == before


def _repin(root: Path, wheel: Path) -> None:
    pin = root / "0.28.0" / "pin.toml"
    text = pin.read_text()
    old = text.split('sha256 = "', 1)[1].split('"', 1)[0]
    pin.write_text(text.replace(old, sha256(wheel)))


@pytest.mark.parametrize("tamper", [
    pytest.param(lambda data: data + b"\0", id="a-byte-appended"),
    pytest.param(_damage_member, id="a-member-damaged"),
])
def test_a_base_wheel_that_is_not_the_pinned_one_is_refused(
    capsys: pytest.CaptureFixture[str], release: tuple[Path, Path], previous: tuple[Path, dict[str, bytes]],
    tmp_path: Path, tamper,
) -> None:
    """Issue 35 item 3: ``build --base-wheel F`` checks F against pin.toml's sha256 like a downloaded wheel.

    Before: ``_check_base`` only checked that F exists; a wheel with a byte appended built and
    installed (exit 0), since ``wheel.py`` trusts the base's RECORD on the assumption it was verified;
    a damaged member came out as "not a readable wheel (Error -3 ...)" with neither digest.
    """
    root, wheel = release
    dist, before = previous
    bad = tmp_path / "tampered" / wheel.name
    bad.parent.mkdir()
    bad.write_bytes(tamper(wheel.read_bytes()))
    line = _cli_build(capsys, root, dist, bad)
    assert line == (f"error: {bad}: sha256 mismatch: expected {sha256(wheel)}, got {sha256(bad)}; it is not the "
                    f"{wheel.name} that pin.toml pins: pass that wheel with --base-wheel (or leave --base-wheel "
                    "out to fetch it)")
    assert _files(dist) == before


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], ids=["022", "002", "077"])
def test_wheel_mode_follows_the_umask(release: tuple[Path, Path], tmp_path: Path, umask: int) -> None:
    """As ``cp`` would make it (0o666 & ~umask), not mkstemp's 0o600."""
    root, wheel = release
    old = os.umask(umask)
    try:
        res = build(root, "0.28.0", tmp_path / "dist", base_wheel=wheel)
    finally:
        os.umask(old)
    assert res.wheel.stat().st_mode & 0o777 == 0o666 & ~umask
