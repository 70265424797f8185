"""The OpenAI-compatible HTTP calls the checks make, over one ``httpx`` client.

Transport errors are left as ``httpx`` exceptions: whether a failed request means "the server
died" is the caller's question (it asks :meth:`overlay.regress.server.Server.alive`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import EventSource


def normalize_base_url(url: str) -> str:
    """``http://h:8000``, ``http://h:8000/`` and ``http://h:8000/v1`` all mean the same server."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


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
        self.http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=10.0))

    def close(self) -> None:
        self.http.close()

    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            return self.http.get("/health", timeout=timeout_s).status_code == 200
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
