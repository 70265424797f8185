"""Builds into one ``dist/`` at once: they take turns, and only a dead build's temporary file is removed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from overlay.build.pipeline import build
from overlay.build.wheel import verify_record

REPO = Path(__file__).resolve().parent.parent

# `python -m overlay build` whose finished temporary wheel waits HOLD seconds before its rename:
# the window in which a second build used to delete it as "stale".
_SLOW_BUILD = """
import sys, time
import overlay.build.pipeline as b
from overlay.cli import main
rewrite = b.rewrite_wheel
def slow(*args, **kwargs):
    rewrite(*args, **kwargs)
    time.sleep(float(sys.argv[1]))
b.rewrite_wheel = slow
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture
def release(one_patch_release: tuple[Path, Path]) -> tuple[Path, Path]:
    return one_patch_release


def _start(root: Path, wheel: Path, dist: Path, hold: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _SLOW_BUILD, str(hold), "--patches", str(root), "build", "--dist", str(dist),
         "--base-wheel", str(wheel)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )


def _temps(dist: Path) -> list[Path]:
    return sorted(dist.glob(".building-*")) if dist.is_dir() else []


@pytest.mark.parametrize("delay", [0.0, 0.4, "mid-write"])
def test_two_builds_at_once_both_succeed(tmp_path: Path, release: tuple[Path, Path], delay: float | str) -> None:
    root, wheel = release
    dist = tmp_path / "dist"
    # mid-write: the first build holds its temporary wheel 6 s, longer than the second one takes to
    # start and reach the lock even on a loaded machine (with 1.5 s, under load 8, it found it free)
    first = _start(root, wheel, dist, hold=6.0 if delay == "mid-write" else 1.5)
    if delay == "mid-write":  # start the second build while the first one's temporary wheel waits
        deadline = time.monotonic() + 60
        while not _temps(dist) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _temps(dist), "the first build never wrote its temporary wheel"
    else:
        time.sleep(float(delay))
    second = _start(root, wheel, dist, hold=0.0)
    out1, err1 = first.communicate(timeout=120)
    out2, err2 = second.communicate(timeout=120)
    assert "Traceback" not in err1 + err2
    assert (first.returncode, second.returncode) == (0, 0), err1 + err2
    assert out1 == out2 and Path(out1.strip()).is_file()
    verify_record(Path(out1.strip()))
    assert _temps(dist) == []
    if delay == "mid-write":
        waiting = [line for line in err2.splitlines() if line.startswith("waiting")]
        assert len(waiting) == 1, err2
        assert f"is held by pid {first.pid} on {socket.gethostname()} since " in waiting[0]
        assert str(dist / ".overlay-build.lock") in waiting[0]


def test_only_temporary_files_of_dead_builds_are_removed(tmp_path: Path, release: tuple[Path, Path]) -> None:
    root, wheel = release
    dist = tmp_path / "dist"
    dist.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_pid = int(gone.stdout)  # exited and reaped: no such process any more
    host = socket.gethostname()
    dead = dist / f".building-{host}-{dead_pid}-abc123.whl.tmp"
    live = dist / f".building-{host}-{os.getpid()}-def456.whl.tmp"  # this test is alive: a build in progress
    for path in (dead, live):
        path.write_bytes(b"partial wheel")
    res = build(root, "0.28.0", dist, base_wheel=wheel)
    assert not dead.exists()
    assert live.read_bytes() == b"partial wheel"
    assert res.wheel.is_file()
