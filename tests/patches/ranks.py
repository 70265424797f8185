"""Run a worker on spawned ranks and collect each rank's JSON report (shared by the harnesses)."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A free TCP port on the loopback for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RETRY_FACTOR = 2  # a rank killed at its timeout is started again once, with this many times the time
RETRIES_ENV = "OVERLAY_RANK_RETRIES"  # overlay/maintain/rebase/testrun.py reads the retries from this file


def spawn_ranks(target: Callable[..., None], args: Callable[[int, int], tuple[Any, ...]], tmp: Path,
                world: int = 2, timeout: float = 240, grace: float = 30) -> list[dict[str, Any]]:
    """Start ``target(*args(rank, port))`` on ``world`` spawned processes; each writes ``tmp/rank<r>.json``.

    Ranks still running after ``timeout`` are killed, and the others ``grace`` seconds after one rank
    reported a fatal error (they would wait on it in a collective). Every rank must write a report
    without a ``fatal`` traceback (see :func:`fatal_report`): a missing report or a fatal one of the
    harness raises ``compat.HarnessError``, a fatal one of the code under test ``compat.BehaviourFailure``.

    A rank killed at its timeout with no rank reporting a failure is the machine's (a loaded machine
    runs the ranks slower), not yet the code's: all ranks are started again once with
    ``RETRY_FACTOR`` times the timeout, and only a second timeout counts (a harness error). Each retry
    is said as a warning and, in a rebase's test run, a line in ``$OVERLAY_RANK_RETRIES`` that its
    report shows.
    """
    import compat

    procs, killed, reports = _spawn_once(target, args, tmp, world, timeout, grace)
    late = _timed_out(reports, killed)
    if late:
        retry = timeout * RETRY_FACTOR
        for r in range(world):
            (tmp / f"rank{r}.json").unlink(missing_ok=True)
        procs, killed, reports = _spawn_once(target, args, tmp, world, retry, grace)
        again = _timed_out(reports, killed)
        _say_retry(late, timeout, retry, "killed again" if again else "finished")
        if again:
            raise compat.HarnessError(f"rank {again[0]} did not finish within {timeout:.0f} s and was killed, nor "
                                      f"within {retry:.0f} s when all ranks were run again (a loaded machine runs "
                                      "the ranks slower; run the test again)")
    for r, rep in enumerate(reports):  # a rank's own failure first: the others may be stopped for it
        if "fatal" in rep:
            error = compat.BehaviourFailure if rep.get("fatal_kind") == "behaviour" else compat.HarnessError
            raise error(f"rank {r}: {rep['fatal'].strip().splitlines()[-1]}\n{rep['fatal']}")
    for r, rep in enumerate(reports):
        if not rep:
            raise compat.HarnessError(f"rank {r} wrote no result (exit code {procs[r].exitcode})")
    return reports


PRELOAD = "rank_preload"  # the module the fork server imports first (tests/patches/rank_preload.py)


def _context() -> Any:
    """Ranks forked from one fork server per test process, which imported torch and vLLM once
    (:data:`PRELOAD`): a rank starts in about a second instead of nine. Like a spawned process, it
    holds nothing of the test process but its arguments and, by :func:`_in_environ`, its environment.

    The server is started here with this process's ``sys.path`` as its ``PYTHONPATH`` (Python 3.11's
    fork server does not take the parent's path itself), so that it imports the vLLM under test."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def _in_environ(environ: dict[str, str], log: str, target: Callable[..., None], *args: Any) -> None:
    """``target(*args)`` in the test process's environment as it was when the rank started (the fork
    server's own is the one it was started with), its output to ``log``, which :func:`_spawn_once`
    hands to the test's output when the rank is done (the fork server's are the first test's)."""
    os.environ.clear()
    os.environ.update(environ)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    target(*args)


def _spawn_once(target: Callable[..., None], args: Callable[[int, int], tuple[Any, ...]], tmp: Path, world: int,
                timeout: float, grace: float) -> tuple[list[Any], list[int], list[dict[str, Any]]]:
    """One start of the ranks: the processes, the ranks killed, each rank's report ({} when none)."""
    import time

    port = free_port()
    ctx = _context()
    environ = dict(os.environ)
    logs = [tmp / f"rank{r}.log" for r in range(world)]
    procs = [ctx.Process(target=_in_environ, args=(environ, str(logs[r]), target, *args(r, port)))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any("fatal" in _read(tmp / f"rank{r}.json") for r in range(world)):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.5)
    killed = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            killed.append(r)
        p.join()
    for r, log in enumerate(logs):
        text = log.read_text(errors="replace") if log.is_file() else ""
        if text:
            sys.stderr.write(f"--- rank {r} of {world} ---\n{text}")
    return procs, killed, [_read(tmp / f"rank{r}.json") for r in range(world)]


def _timed_out(reports: list[dict[str, Any]], killed: list[int]) -> list[int]:
    """The ranks killed at the timeout without a report, when no rank reported a failure (else [])."""
    if any("fatal" in rep for rep in reports):
        return []
    return [r for r in killed if not reports[r]]


def _say_retry(ranks: list[int], timeout: float, retry: float, then: str) -> None:
    import os
    import warnings

    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0].rsplit("::", 1)[-1] or "?"
    warnings.warn(f"{test}: rank(s) {', '.join(map(str, ranks))} killed at their {timeout:.0f} s timeout (a "
                  f"loaded machine), run again with {retry:.0f} s: {then}", stacklevel=3)
    path = os.environ.get(RETRIES_ENV)
    if path:
        line = {"test": test, "ranks": ranks, "timeout": timeout, "retry_timeout": retry, "then": then}
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet, or being written
        return {}


def fatal_report(exc: BaseException) -> dict[str, str]:
    """What a rank writes when it stops on ``exc``: the traceback, and whose failure it is
    (``behaviour`` when raised in a ``compat.exercising`` region or when vLLM's own source does not
    compile, else ``harness``)."""
    import traceback

    kind = "behaviour" if _vllm_does_not_compile(exc) else getattr(type(exc), "overlay_failure", "harness")
    return {"fatal": "".join(traceback.format_exception(exc)), "fatal_kind": kind}


def _vllm_does_not_compile(exc: BaseException) -> bool:
    """A ``SyntaxError`` in ``exc``'s chain for a file of the vLLM under test (``$OVERLAY_VLLM_TREE``,
    else where ``vllm`` would be imported from): the code is broken, not the harness."""
    import importlib.util
    import os

    roots = [Path(t).resolve() for t in [os.environ.get("OVERLAY_VLLM_TREE")] if t]
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    roots += [Path(p).resolve() for p in (spec.submodule_search_locations or [])] if spec else []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, SyntaxError) and cur.filename:
            path = Path(cur.filename).resolve()
            if any(path == r or r in path.parents for r in roots):
                return True
        cur = cur.__cause__ or cur.__context__
    return False


RANKS_ENV = "OVERLAY_DCP_RANKS"


def parse_ranks(value: str | None, default: int = 2) -> int:
    """The DCP rank count named by ``OVERLAY_DCP_RANKS``: an int >= 2 and a power of two."""
    if value is None or not value.strip():
        return default
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{RANKS_ENV}={value!r}: not an integer (want a power of two >= 2)") from None
    if n < 2 or n & (n - 1):
        raise ValueError(f"{RANKS_ENV}={value!r}: want a power of two >= 2 (2, 4, 8, ...)")
    return n


def dcp_ranks() -> int:
    """How many ranks (TP = DCP = N) the GPU tests spawn: ``OVERLAY_DCP_RANKS``, default 2."""
    import os

    return parse_ranks(os.environ.get(RANKS_ENV))


def gpu_ranks() -> int:
    """:func:`dcp_ranks`, after skipping the calling test when fewer CUDA devices exist."""
    import pytest
    import torch

    n = dcp_ranks()
    have = torch.cuda.device_count()
    if have < n:
        pytest.skip(f"needs {n} CUDA devices ({RANKS_ENV}={n}), found {have}")
    return n
