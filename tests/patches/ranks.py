"""Run a worker on spawned ranks and collect each rank's JSON report (shared by the harnesses)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A free TCP port on the loopback for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target: Callable[..., None], args: Callable[[int, int], tuple[Any, ...]], tmp: Path,
                world: int = 2, timeout: float = 240) -> list[dict[str, Any]]:
    """Start ``target(*args(rank, port))`` on ``world`` spawned processes; each writes ``tmp/rank<r>.json``.

    Ranks still running after ``timeout`` are killed. Asserts every rank wrote a report and
    none of them carries a ``fatal`` traceback.
    """
    import multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args(r, port)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    reports = []
    for r in range(world):
        f = tmp / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result (exit code {procs[r].exitcode})"
        rep = json.loads(f.read_text())
        assert "fatal" not in rep, rep["fatal"]
        reports.append(rep)
    return reports
