"""bench-engine's measurement: streamed requests (SSE chunk arrivals) and the server's ITL from /metrics."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from httpx_sse import EventSource

from overlay.bench.engine.cells import Cell, fresh_prompt
from overlay.bench.engine.common import BenchError
from overlay.bench.engine.servers import death_of, side_of
from overlay.bench.engine.stats import Request
from overlay.regress.server import Server


def _body(model: str, prompt: list[int], max_tokens: int) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()


async def stream_request(client: httpx.AsyncClient, body: bytes, start: float, req: Request) -> Request:
    """Send one pre-serialized streaming completion; record each token-bearing chunk's arrival."""
    req.sent = time.perf_counter() - start
    async with client.stream("POST", "/v1/completions", content=body,
                             headers={"Content-Type": "application/json"}) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            raise BenchError(f"/v1/completions answered {r.status_code}: {' '.join(text.split())[:300]}")
        seen = 0
        # Not r.aiter_lines(): it splits at every str.splitlines() boundary, and completion text
        # (the byte tokenizer's U+0085, U+2028) arrives raw inside the JSON of a data line.
        async for event in EventSource(r).aiter_sse():
            payload = event.data.strip()
            if payload == "[DONE]":
                break
            now = time.perf_counter() - start
            data = json.loads(payload)
            choices = data.get("choices") or []
            if not choices:  # the final usage chunk
                details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    req.cached_tokens = int(details["cached_tokens"])
                continue
            usage = data.get("usage") or {}
            if usage.get("completion_tokens") is not None:
                count = int(usage["completion_tokens"]) - seen
            elif choices[0].get("token_ids") is not None:
                count = len(choices[0]["token_ids"])
            else:
                count = 1
            if count <= 0:
                continue
            seen += count
            req.arrivals.append(now)
            req.tokens.append(count)
    if not req.arrivals:
        raise BenchError("a stream carried no tokens")
    return req


async def _run_async(url: str, model: str, prompts: list[list[int]], max_tokens: int, timeout_s: float,
                     mixed: tuple[int, float, int, str] | None) -> list[Request]:
    """All ``prompts`` at once (+ the mixed cell's arriving prefills: context, interval, seed, tag)."""
    bodies = [_body(model, p, max_tokens) for p in prompts]
    limits = httpx.Limits(max_connections=len(prompts) + 64, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits) as cl:
        start = time.perf_counter()
        reqs = [Request(0.0, prompt_tokens=len(p)) for p in prompts]
        tasks = [asyncio.create_task(stream_request(cl, b, start, r)) for b, r in zip(bodies, reqs, strict=True)]
        extra: list[asyncio.Task[Request]] = []
        prefills: list[Request] = []
        try:
            if mixed is not None:
                context, interval, seed, tag = mixed
                decodes = asyncio.gather(*tasks)
                k = 0
                while not decodes.done():
                    try:
                        await asyncio.wait_for(asyncio.shield(decodes), timeout=interval)
                    except TimeoutError:
                        pass
                    if decodes.done():
                        break
                    k += 1
                    req = Request(0.0, prompt_tokens=context, kind="prefill")
                    prefills.append(req)
                    body = _body(model, fresh_prompt(context, seed, f"{tag}:{k}"), 1)
                    extra.append(asyncio.create_task(stream_request(cl, body, start, req)))
                await decodes
            await asyncio.gather(*tasks, *extra)
        finally:
            for t in [*tasks, *extra]:
                t.cancel()
            await asyncio.gather(*tasks, *extra, return_exceptions=True)
    return reqs + prefills


ITL_FAMILY = "vllm:inter_token_latency_seconds"


def itl_totals(text: str) -> tuple[float, float] | None:
    """(sum, count) of vLLM's inter-token latency histogram in a ``/metrics`` text, every engine summed;
    None when the server exposes none."""
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        if family.name != ITL_FAMILY:
            continue
        for sample in family.samples:
            if sample.name == ITL_FAMILY + "_sum":
                total += sample.value
                found = True
            elif sample.name == ITL_FAMILY + "_count":
                count += sample.value
    return (total, count) if found else None


def scrape_itl(server: Server) -> tuple[float, float] | None:
    """The server's inter-token latency totals now; None when ``/metrics`` cannot be read or has none."""
    try:
        r = httpx.get(f"{server.base_url}/metrics", timeout=10.0)
        r.raise_for_status()
        return itl_totals(r.text)
    except (httpx.HTTPError, ValueError):
        return None


def itl_ms_between(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Mean inter-token latency (ms) the server measured between two scrapes: vLLM's own timestamps
    of every token after each request's first, free of the client's (asyncio, SSE) jitter."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return 1000.0 * (after[0] - before[0]) / (after[1] - before[1])


def run_once(server: Server, cell: Cell, prompts: list[list[int]], max_tokens: int, timeout_s: float,
             mixed: tuple[int, float, int, str] | None = None) -> list[Request]:
    """One run of a cell against ``server``; a transport error asks whether the server died."""
    try:
        return asyncio.run(_run_async(server.base_url, server.model, prompts, max_tokens, timeout_s, mixed))
    except (httpx.HTTPError, json.JSONDecodeError, BenchError) as exc:
        cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise BenchError(death_of(server) or f"cell {cell.name}: server {side_of(server)}: {cause}") from None


