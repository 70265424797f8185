"""The server under test: launch ``vllm serve`` from a profile, or attach to ``BASE_URL``.

Readiness is ``/health`` answering 200 *and* ``/v1/models`` listing the profile's served model,
within a timeout. A launched server's output goes to ``server.log`` in the report folder. A
server that exits (launched) or stops answering ``/health`` (attached) is dead: callers raise
:class:`ServerDied`, which the run reports as a regression, not as a harness failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from overlay.regress.client import Client, normalize_base_url
from overlay.regress.errors import RegressError, ServerDied
from overlay.regress.profiles import ServerSpec


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
    def launch(cls, spec: ServerSpec, log_path: Path) -> Server:
        cmd = spec.command()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            try:
                # Own session: stop() signals the whole process group (API server + engine workers).
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env={**os.environ, **spec.env}, start_new_session=True)
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
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
