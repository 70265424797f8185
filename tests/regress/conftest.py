"""Fixture for the regression tests: the stand-in server as a separate process on a free port.

Every wait is bounded; every process started here is stopped at teardown.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from regress_helpers import free_port, standin_command, wait_port


@dataclass
class Standin:
    url: str
    proc: subprocess.Popen[bytes]


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[Callable[..., Standin]]:
    """Start a stand-in: ``standin("healthy", "--start-delay", "3", wait=False)``."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(mode: str, *extra: str, wait: bool = True) -> Standin:
        port = free_port()
        log = (tmp_path / f"standin-{mode}-{port}.log").open("wb")
        proc = subprocess.Popen(standin_command(port, mode, *extra), stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        if wait and not wait_port(port, 15):
            raise RuntimeError(f"stand-in ({mode}) did not bind 127.0.0.1:{port}")
        return Standin(f"http://127.0.0.1:{port}", proc)

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


