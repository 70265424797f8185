"""The server under test: launch ``vllm serve`` from a profile, or attach to ``BASE_URL``.

Readiness is ``/health`` answering 200 *and* ``/v1/models`` listing the profile's served model,
within a timeout. A launched server's output goes to ``server.log`` in the report folder. A
server that exits (launched) or stops answering ``/health`` (attached) is dead: callers raise
:class:`ServerDied`, which the run reports as a regression, not as a harness failure.

A launched server must not outlive the run (it holds the GPUs and the port, and the next run would
judge *it*): :func:`start_server` binds it to the run (SIGTERM when the run dies, even by SIGKILL;
vLLM stops its engine on SIGTERM) and records it in ``$TMPDIR/vllm-overlay-<uid>/servers/<port>.json``
until it is stopped. Before a launch, a server a killed run left on the port (its run gone, its process
group still there) is stopped, and said so; anything else listening there is refused as a harness
failure, never taken for the server just launched.

A launched server must also run what its profile says: vLLM starts without a ``VLLM_*`` variable it does not
read and only logs "Unknown vLLM environment variable detected: NAME" (0.34.0 so ignores 0.28.0's
``VLLM_DCP_PROJECT_BEFORE_MERGE``). Once it is ready, :meth:`Server.check_env_read` reads its log for such a
line about a variable the profile's ``server.env`` sets, and refuses the run as a harness failure naming it.
Arguments are the other way round: ``vllm serve`` refuses one it does not take ("unrecognized arguments", exit
2; 0.28.0 so refuses 0.34.0's ``--dcp-v-up-proj-before-merge``); a server that exits before it is ready with that
in its log is a harness failure naming ``server.args`` (:meth:`Server.check_args_taken`), not a regression.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import httpx

from overlay.atomic import pid_alive, write_file
from overlay.interrupt import bound_to_parent
from overlay.regress.client import Client, normalize_base_url
from overlay.regress.errors import RegressError, ServerDied
from overlay.regress.profiles import ServerSpec
from overlay.releases.projection import ARGUMENT as PROJECTION_ARGUMENT
from overlay.releases.projection import PROJECTION_ENV

UNKNOWN_ENV = re.compile(r"Unknown vLLM environment variable detected: ([A-Za-z0-9_]+)")
"""What vLLM (0.28.0 and 0.34.0: ``validate_environ``) logs for a ``VLLM_*`` variable it does not read."""
UNKNOWN_ARGS = re.compile(r"error: unrecognized arguments: (.+?)\s*$")
"""What ``vllm serve``'s argument parser (argparse) prints, before it exits with status 2, for arguments it does not
take (0.28.0 so refuses 0.34.0's ``--dcp-v-up-proj-before-merge``)."""


class Server:
    def __init__(self, base_url: str, model: str, proc: subprocess.Popen[bytes] | None = None,
                 log_path: Path | None = None) -> None:
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.proc = proc
        self.log_path = log_path
        self.client = Client(self.base_url, model)

    @classmethod
    def attach(cls, base_url: str, spec: ServerSpec) -> Server:
        return cls(base_url, spec.served_model_name)

    @classmethod
    def launch(cls, spec: ServerSpec, log_path: Path, progress: Callable[[str], None] | None = None) -> Server:
        cmd = spec.command()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            try:
                proc = start_server(cmd, {**os.environ, **spec.env}, log, spec.host, spec.port, progress,
                                    "server.port")
            except FileNotFoundError:
                raise RegressError(f"server.vllm_bin: {spec.vllm_bin!r} not found; install the patched "
                                   "wheel on this node or attach to a running server with BASE_URL=") from None
        return cls(f"http://{spec.host}:{spec.port}", spec.served_model_name, proc, log_path)

    @property
    def launched(self) -> bool:
        return self.proc is not None

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def unread_env(self, env: dict[str, str]) -> list[str]:
        """The names of ``env`` that the launched server's log says its vLLM does not read, in ``env``'s order
        (none for an attached server: its log is not ours)."""
        if self.log_path is None or not self.log_path.exists():
            return []
        unknown: set[str] = set()
        with self.log_path.open(encoding="utf-8", errors="replace") as log:
            for line in log:
                if "Unknown vLLM environment variable" in line:
                    unknown.update(UNKNOWN_ENV.findall(line))
        return [name for name in env if name in unknown]

    def check_env_read(self, env: dict[str, str], where: str) -> None:
        """Raise RegressError (one line naming ``where``'s ``server.env.NAME``) when the launched server's log
        says its vLLM does not read a variable the profile sets: the server would not run what the profile says."""
        unread = self.unread_env(env)
        if not unread:
            return
        fields = ", ".join(f"server.env.{name}" for name in unread)
        hint = (f"; our 0.34.0 series takes the projection as {PROJECTION_ARGUMENT} auto|on|off in server.args"
                if PROJECTION_ENV in unread else "")
        log = self.log_path.name if self.log_path is not None else "the server log"
        it = "it" if len(unread) == 1 else "them"
        raise RegressError(f"{where}: {fields}: the vLLM this profile started does not read {it} ({log}: "
                           f"\"Unknown vLLM environment variable detected: {unread[0]}\"), so the server does not run "
                           f"what the profile says; set {it} the way that build reads {it}, or remove {it}{hint}")

    def check_args_taken(self) -> None:
        """Raise RegressError (one line naming ``server.args``) when the launched server's log says its argument
        parser refused arguments: a server that cannot start with the profile's arguments is the profile's
        mismatch with the build, not a regression of the build."""
        if self.log_path is None or not self.log_path.exists():
            return
        with self.log_path.open(encoding="utf-8", errors="replace") as log:
            refused = [m.group(1) for m in map(UNKNOWN_ARGS.search, log) if m]
        if not refused:
            return
        hint = (f"; 0.28.0's series takes the projection as server.env {PROJECTION_ENV}=1|0"
                if PROJECTION_ARGUMENT in refused[-1] else "")
        log_name = self.log_path.name
        raise RegressError(f"server.args: the vLLM this profile started does not take {refused[-1]} ({log_name}: "
                           f"\"unrecognized arguments\") and stopped at start-up; give the arguments that build "
                           f"takes{hint}")

    def wait_ready(self, timeout_s: float, progress: Callable[[str], None], poll_s: float = 2.0,
                   refused_timeout_s: float | None = None) -> float:
        """Block until ready; return the seconds it took. Raise ServerDied or RegressError.

        ``refused_timeout_s`` (attached servers): give up once connections have been refused that
        long without the server ever answering; a server we did not start will not come up by itself.
        """
        start = time.monotonic()
        deadline = start + timeout_s
        next_note = start + 30.0
        last = "no answer yet"
        answered = False
        while True:
            rc = self.exited()
            if rc is not None:
                self.check_args_taken()
                raise ServerDied("startup", f"vllm serve exited with status {rc} before it was ready"
                                 + self._tail_suffix())
            try:
                health = self.client.http.get("/health", timeout=5.0)
                answered = True
                if health.status_code == 200:
                    models = self.client.models()
                    if self.model in models:
                        return time.monotonic() - start
                    if models:
                        raise RegressError(f"{self.base_url} serves {', '.join(models)}, not the profile's "
                                           f"served model {self.model!r} (server.served_model_name)")
                    last = "/v1/models lists no model yet"
                else:
                    last = f"/health answered {health.status_code}"
            except httpx.HTTPError as exc:
                answered = answered or not isinstance(exc, httpx.ConnectError)  # a timeout: something listens
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            now = time.monotonic()
            if not answered and refused_timeout_s is not None and now - start >= refused_timeout_s:
                raise RegressError(f"nothing answers at {self.base_url}: connection refused for "
                                   f"{refused_timeout_s:.0f} s ({last}); start the server or fix BASE_URL, or raise "
                                   "server.attach_timeout_s / REGRESS_ATTACH_TIMEOUT if it is still starting")
            if now >= deadline:
                raise RegressError(f"server at {self.base_url} not ready after {timeout_s:.0f} s ({last}); "
                                   "raise server.ready_timeout_s or --ready-timeout if it is still loading")
            if now >= next_note:
                progress(f"server: waiting for {self.base_url} ({int(now - start)} s, {last})")
                next_note = now + 30.0
            wake = deadline if answered or refused_timeout_s is None else min(deadline, start + refused_timeout_s)
            time.sleep(min(poll_s, max(0.05, wake - now)))

    def alive(self, attempts: int = 3, pause_s: float = 1.0) -> bool:
        """Whether the server still answers; a few tries, so one slow /health is not a death."""
        for i in range(attempts):
            if self.exited() is not None:
                return False
            if self.client.health():
                return True
            if i + 1 < attempts:
                time.sleep(pause_s)
        return False

    def ensure_alive(self, step: str, cause: str) -> None:
        """After ``cause`` went wrong in ``step``: raise ServerDied if the server is gone."""
        if not self.alive():
            rc = self.exited()
            how = f"exited with status {rc}" if rc is not None else "stopped answering /health"
            raise ServerDied(step, f"{how} ({cause})" + self._tail_suffix())

    def _tail_suffix(self) -> str:
        tail = self.log_tail(3).strip()
        return f"; server log ends: {tail.splitlines()[-1]}" if tail else ""

    def stop(self, grace_s: float = 30.0) -> None:
        self.client.close()
        if self.proc is None:
            return
        try:
            self._stop(grace_s)
        finally:
            forget_server(self.proc.pid)

    def _stop(self, grace_s: float) -> None:
        """Stop the whole process group, also when its leader (the API server) exited already and left
        engine workers behind (they hold the GPUs and, often, the port)."""
        assert self.proc is not None
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            self.proc.poll()  # reap the leader: a group of its zombie alone is gone
            if not _group_alive(pgid):
                return
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.proc.poll()
                if not _group_alive(pgid):
                    return
                time.sleep(0.05)


# --- launched servers: bound to the run, recorded until stopped ------------------------------------


def start_server(cmd: list[str], env: dict[str, str], log: IO[bytes], host: str, port: int,
                 progress: Callable[[str], None] | None = None, port_field: str = "port") -> subprocess.Popen[bytes]:
    """Start a server in its own session (``stop`` signals the whole group: API server and engine workers),
    bound to this run and recorded (see the module docstring), once ``host:port`` is free."""
    say = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    stop_left_server(port, say)
    if _listening(host, port):
        raise RegressError(f"{port_field} {port}: something already listens on {host}:{port}, and no run of this "
                           "tool left it there: a run would judge that server, not the one it starts; stop it "
                           f"or give another {port_field}")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True, preexec_fn=bound_to_parent(signal.SIGTERM))
    record = {"pid": proc.pid, "start": _start_time(proc.pid), "run": os.getpid(),
              "run_start": _start_time(os.getpid()), "cmd": cmd}
    folder = _record_dir(create=True)
    if folder is not None:  # without a record the SIGTERM binding still stops it with the run
        with contextlib.suppress(OSError):
            write_file(folder / f"{port}.json", json.dumps(record) + "\n")
    return proc


def stop_left_server(port: int, say: Callable[[str], None], grace_s: float = 30.0) -> bool:
    """Stop the server a killed run left on ``port`` (its record names a run that is gone and a process
    group that is still there); say so. False when there is none."""
    folder = _record_dir()
    if folder is None:
        return False
    path = folder / f"{port}.json"
    try:
        rec = json.loads(path.read_text())
        pid, run = int(rec["pid"]), int(rec["run"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if pid_alive(run) and _start_time(run) == rec.get("run_start"):
        return False  # its run is alive: its server, not a leftover
    start = _start_time(pid)
    if (start is not None and start != rec.get("start")) or not _group_alive(pid):
        path.unlink(missing_ok=True)  # gone already (or the pid is another process's now)
        return False
    say(f"server: stopping process group {pid} on port {port} ({' '.join(map(str, rec.get('cmd', [])))[:120]}), "
        f"left running by a regress run that was killed (pid {run})")
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while _group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _group_alive(pid):
            break
    path.unlink(missing_ok=True)
    return True


def forget_server(pid: int) -> None:
    """Drop the record of the server ``pid`` (it was stopped)."""
    folder = _record_dir()
    for path in folder.glob("*.json") if folder is not None else ():
        try:
            if int(json.loads(path.read_text()).get("pid", -1)) == pid:
                path.unlink(missing_ok=True)
        except (OSError, ValueError, TypeError, AttributeError):
            continue


def _record_dir(*, create: bool = False) -> Path | None:
    """``$TMPDIR/vllm-overlay-<uid>/servers``: per machine (a server does not outlive a reboot) and per
    user. Only a folder of this user's that nobody else may write is read or written (a record names a
    process group to stop: in a shared ``/tmp`` another user must not plant one); else None."""
    base = Path(tempfile.gettempdir()) / f"vllm-overlay-{os.geteuid()}"
    for folder in (base, base / "servers"):
        if create:
            with contextlib.suppress(FileExistsError, OSError):
                folder.mkdir(mode=0o700)
        try:
            st = os.lstat(folder)
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return None
    return base / "servers"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22): with the pid,
    it names one process, never a later one with the same pid."""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return line.rsplit(")", 1)[-1].split()[19]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _listening(host: str, port: int) -> bool:
    target = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    try:
        with socket.create_connection((target, port), timeout=1.0):
            return True
    except OSError:
        return False
