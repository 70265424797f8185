"""Helpers for tests that SIGKILL a child: whether a process is gone, a bounded wait, a kill at a marked point."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def gone(pid: int) -> bool:
    """Whether ``pid`` is no running process (a zombie nobody reaped counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds passed; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def kill9_when(proc: subprocess.Popen, ready: Callable[[], bool], what: str, timeout: float = 60.0) -> None:  # type: ignore[type-arg]
    """SIGKILL ``proc`` once ``ready()`` holds (it must still run then); never leave it running."""
    try:
        assert wait_for(lambda: ready() or proc.poll() is not None, timeout), what
        assert proc.poll() is None, f"{what}: the child exited first" + (
            f": {proc.stderr.read()}" if proc.stderr else "")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
