"""The OpenAI-compatible HTTP calls the checks make, over one ``httpx`` client.

Transport errors are left as ``httpx`` exceptions: whether a failed request means "the server
died" is the caller's question (it asks :meth:`overlay.regress.server.Server.alive`).

Every request has a **whole-request deadline**, not only httpx's per-read timeout (which a server
sending one byte every 2 s never trips): its timeout (the client's, or the one the call passes) is
the most the whole exchange, connect to last byte, may take; past it, the request ends in
:class:`httpx.ReadTimeout` ("no complete reply within N s"). A ``429`` whose ``Retry-After`` fits in
what is left of the deadline is waited out and sent again; any other ``429`` is the caller's
:class:`httpx.HTTPStatusError`, which :func:`describe` names with its ``Retry-After``.
"""

from __future__ import annotations

import contextvars
import email.utils
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpcore
import httpx
from httpx_sse import EventSource

from overlay import numbers
from overlay.errors import UsageError

# Until when the request running in this thread (context) may still read or write: set by
# _DeadlineTransport around the exchange and each read of the reply's body.
_DEADLINE: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar("regress_deadline",
                                                                                       default=None)
_T = TypeVar("_T")
MAX_RETRY_AFTER_WAITS = 5  # 429s waited out per request, each within the deadline


def check_url(url: str, what: str) -> str:
    """``url`` when it is an http(s) URL with a host and, if it names one, a port 1 to 65535; else a one-line
    :class:`UsageError` naming ``what``.

    ``file:///...`` (any other scheme) can never answer; refused before a run starts rather than after
    the ready timeout. A port out of range is refused, not wrapped: httpx takes ``:99999`` modulo 65536 and
    connects to 34463, where another server may answer and pass the run."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        why = f"its scheme is {parts.scheme!r}" if parts.scheme not in ("http", "https") else "it names no host"
        raise UsageError(f"{what} {url!r}: not an http:// or https:// server URL ({why})")
    host_port = parts.netloc.rpartition("@")[2]
    text = host_port.rpartition("]")[2] if host_port.startswith("[") else host_port
    text = text.partition(":")[2] if ":" in text else ""
    if text:
        if not text.isdigit():
            raise UsageError(f"{what} {url!r}: its port {text!r} is not a number")
        wrong = numbers.problem(int(text), 1, high=65535)
        if wrong:
            raise UsageError(f"{what} {url!r}: its port {wrong}")
    return url


def normalize_base_url(url: str) -> str:
    """``http://h:8000``, ``http://h:8000/`` and ``http://h:8000/v1`` all mean the same server."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


_TIMEOUTS = {"connect": httpcore.ConnectTimeout, "read": httpcore.ReadTimeout, "write": httpcore.WriteTimeout}


def _under_deadline(what: str, timeout: float | None, call: Callable[[float | None], _T]) -> _T:
    """``call(timeout)``, its timeout cut to what is left of this request's deadline; a timeout that the
    deadline caused says so (a trickling server otherwise keeps every single read short)."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return call(timeout)
    end, total = deadline
    left = end - time.monotonic()
    message = f"no complete reply within {total:g} s (the request's whole deadline)"
    if left <= 0:
        raise _TIMEOUTS[what](message)
    if timeout is not None and timeout < left:
        return call(timeout)
    try:
        return call(left)
    except _TIMEOUTS[what]:
        raise _TIMEOUTS[what](message) from None


class _DeadlineStream(httpcore.NetworkStream):
    """A socket stream whose every read and write waits no longer than the request's deadline."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self.inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return _under_deadline("read", timeout, lambda t: self.inner.read(max_bytes, t))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        _under_deadline("write", timeout, lambda t: self.inner.write(buffer, t))

    def close(self) -> None:
        self.inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(_under_deadline("connect", timeout,
                                               lambda t: self.inner.start_tls(ssl_context, server_hostname, t)))

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self.inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        return _DeadlineStream(_under_deadline(
            "connect", timeout, lambda t: self.inner.connect_tcp(host, port, t, local_address, socket_options)))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> httpcore.NetworkStream:
        return _DeadlineStream(_under_deadline(
            "connect", timeout, lambda t: self.inner.connect_unix_socket(path, t, socket_options)))

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


class _DeadlineBody(httpx.SyncByteStream):
    """The reply's body, read under the request's deadline (each chunk's reads are clamped to it)."""

    def __init__(self, inner: httpx.SyncByteStream, deadline: tuple[float, float]) -> None:
        self.inner, self.deadline = inner, deadline

    def __iter__(self) -> Iterator[bytes]:
        chunks = iter(self.inner)
        while True:
            token = _DEADLINE.set(self.deadline)
            try:
                chunk = next(chunks, None)
            finally:
                _DEADLINE.reset(token)
            if chunk is None:
                return
            yield chunk

    def close(self) -> None:
        self.inner.close()


def retry_after_s(response: httpx.Response) -> float | None:
    """A reply's ``Retry-After`` in seconds (delta-seconds or an HTTP date), or None."""
    raw = (response.headers.get("retry-after") or "").strip()
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time()) if when is not None else None


class _DeadlineTransport(httpx.BaseTransport):
    """httpx's own transport, with the whole-request deadline and ``Retry-After`` honoured on 429."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        pool = self.inner._pool  # httpx 0.28 / httpcore 1.0 (pinned): the pool's sockets come from here
        pool._network_backend = _DeadlineBackend(pool._network_backend)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout") or {}
        total = request.extensions.get("deadline") or timeout.get("read")
        if not total:
            return self.inner.handle_request(request)
        deadline = (time.monotonic() + float(total), float(total))
        token = _DEADLINE.set(deadline)
        try:
            for waited in range(MAX_RETRY_AFTER_WAITS + 1):
                response = self.inner.handle_request(request)
                wait = retry_after_s(response) if response.status_code == 429 else None
                if wait is None or waited == MAX_RETRY_AFTER_WAITS or wait >= deadline[0] - time.monotonic():
                    break
                response.close()
                time.sleep(wait)
        finally:
            _DEADLINE.reset(token)
        response.stream = _DeadlineBody(response.stream, deadline)  # type: ignore[arg-type]
        return response

    def close(self) -> None:
        self.inner.close()


def rate_limited(exc: BaseException) -> bool:
    """Whether ``exc`` is a 429 the server kept answering (it is alive, it refuses the load)."""
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 429


def describe(exc: BaseException) -> str:
    """One line for a failed request: the status and body start of an HTTP error (a 429 with its
    Retry-After), else the exception's type and text."""
    if isinstance(exc, httpx.HTTPStatusError):
        r = exc.response
        if r.status_code == 429:
            after = r.headers.get("retry-after")
            return (f"HTTP 429 Too Many Requests: the server refuses the load (Retry-After: {after}, beyond what "
                    "was left of the request's deadline)" if after else
                    "HTTP 429 Too Many Requests: the server refuses the load (no Retry-After)")
        try:
            body = r.text[:200]
        except httpx.StreamError:  # a streamed reply nobody read (or closed unread): its status is still known
            body = "(the reply's body was not read)"
        except httpx.HTTPError:
            body = ""
        return f"HTTP {r.status_code}: {body}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int | None
    completion_tokens: int | None


@dataclass
class StreamTiming:
    ttft_s: float
    latency_s: float
    output_tokens: int
    itls_s: list[float] = field(default_factory=list)


class Client:
    def __init__(self, base_url: str, model: str, timeout_s: float = 600.0) -> None:
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                 transport=_DeadlineTransport())

    def close(self) -> None:
        self.http.close()

    def health(self, timeout_s: float = 5.0) -> bool:
        """Whether the server answers ``/health``: 200, or 429 (alive, refusing the load: not a death)."""
        try:
            return self.http.get("/health", timeout=timeout_s).status_code in (200, 429)
        except httpx.HTTPError:
            return False

    def models(self, timeout_s: float = 10.0) -> list[str]:
        r = self.http.get("/v1/models", timeout=timeout_s)
        r.raise_for_status()
        return [m["id"] for m in r.json().get("data", [])]

    def metrics_text(self) -> str:
        r = self.http.get("/metrics", timeout=30.0)
        r.raise_for_status()
        return r.text

    def chat(self, content: str, max_tokens: int, extra_body: dict[str, Any] | None = None) -> Completion:
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "temperature": 0.0, **(extra_body or {})}
        r = self.http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        data = r.json()
        message = data["choices"][0]["message"]
        # With a reasoning parser the answer is in content; fall back to the reasoning text when
        # a model answered only there, so an answer is never missed for where it was put.
        text = message.get("content") or message.get("reasoning_content") or message.get("reasoning") or ""
        usage = data.get("usage") or {}
        return Completion(text, usage.get("prompt_tokens"), usage.get("completion_tokens"))

    def stream_completion(self, prompt: str, max_tokens: int) -> StreamTiming:
        """One streamed completion timed like ``vllm bench serve``: TTFT, ITLs, end-to-end."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        ttft = None
        last = start
        itls: list[float] = []
        chunks = 0
        usage_tokens = None
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.is_error:
                r.read()  # the error's body, for describe() (read under the request's deadline)
            r.raise_for_status()
            # SSE events, not r.iter_lines(): that also splits at U+0085 / U+2028 inside the JSON.
            for event in EventSource(r).iter_sse():
                payload = event.data.strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if data.get("usage"):
                    usage_tokens = data["usage"].get("completion_tokens")
                if not any(c.get("text") for c in data.get("choices") or []):
                    continue
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                else:
                    itls.append(now - last)
                last = now
                chunks += 1
        end = time.perf_counter()
        if ttft is None:
            raise ValueError("the stream carried no tokens")
        return StreamTiming(ttft_s=ttft, latency_s=end - start, output_tokens=usage_tokens or chunks, itls_s=itls)
