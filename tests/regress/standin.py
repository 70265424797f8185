"""A CPU stand-in for `vllm serve`: an OpenAI-compatible HTTP server that is healthy or broken on purpose.

Run as its own process (``python tests/regress/standin.py --port P --mode MODE``). It serves
``/health``, ``/v1/models``, ``/v1/completions`` (streaming too), ``/v1/chat/completions`` and
``/metrics`` (vLLM's spec-decode counters in Prometheus text form), and answers the regression's
prompts: counting, ``a + b``, "translate hello to French", the long-context needle, GSM8K
questions (looked up by question text in a GSM8K-format fixture), and random latency prompts.

Modes, each the symptom of one reported failure (the production report; docs/ARCHITECTURE.md, "The problem"):

- ``healthy``: right answers, a healthy MTP acceptance curve.
- ``repetition``: prompts longer than ``--long-tokens`` decode into a loop.
- ``accumulate``: after the first long prompt every request is a little more wrong than the last.
- ``collapse``: right answers, but per-position acceptance ``1.0, 1.0, 0.26, ...``.
- ``dies``: the process exits (engine crash) on the first prompt longer than ``--capacity``.
- ``skew``: right answers, but logprobs whose context exceeds ``--long-tokens`` are 1.5 nats off
  (silent corruption past ``index_topk``: only the differential check sees it).

Token-id prompts (``"prompt": [ids]``) are answered like vLLM's completions API with
``logprobs``, ``prompt_logprobs``, ``return_tokens_as_token_ids`` and ``return_token_ids``: a
deterministic toy model, so that two healthy stand-ins agree exactly. Streamed (``"stream": true``)
they come one token per chunk, with ``stream_options`` ``include_usage`` / ``continuous_usage_stats``
honoured (``make bench-engine``'s tests).

``--reply-fault`` breaks the token-id replies (no choices, prompt logprobs cut short, top logprobs
as lists, 3 tokens whatever ``max_tokens``): a reference server gone wrong.

``--die-after N`` kills the process (SIGKILL, no message) on request N + 1: a server dying mid-run.

``--start-delay`` makes any mode start slowly: the port is bound only after that many seconds,
as vLLM binds only once the engine is loaded.

``--trickle S`` sends every POST reply's body one byte every S seconds (the headers at once): a
server that never stops answering and never finishes. ``--rate-limit N`` answers the first N POST
requests ``429 Too Many Requests`` with ``Retry-After: --retry-after`` (a proxy or gateway in front).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import prometheus_client

HEALTHY_ACCEPTANCE = [0.97, 0.83, 0.40, 0.39, 0.38]
COLLAPSED_ACCEPTANCE = [1.0, 1.0, 0.26, 0.20, 0.10]
TOKEN_RE = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> int:
    return len(TOKEN_RE.findall(text))


class State:
    """Everything the server remembers between requests; one lock guards it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lock = threading.Lock()
        self.corruption = 0
        self.long_seen = False
        self.requests = 0
        self.posts = 0  # POST requests seen, for --rate-limit
        self.drafts = 0.0
        self.draft_tokens = 0.0
        self.accepted = [0.0] * args.spec_tokens
        self.itls: list[float] = []  # seconds between a streamed request's tokens (vllm:inter_token_latency)
        self.gsm8k: dict[str, str] = {}
        if args.gsm8k:
            for split in ("train", "test"):
                for line in (Path(args.gsm8k) / f"{split}.jsonl").read_text().splitlines():
                    row = json.loads(line)
                    self.gsm8k[_norm(row["question"])] = row["answer"]

    def on_request(self, prompt_tokens: int) -> int:
        """Count a request; return the corruption level it is answered with."""
        with self.lock:
            self.requests += 1
            if self.args.die_after and self.requests > self.args.die_after:
                os.kill(os.getpid(), signal.SIGKILL)  # killed without a word, as the OOM killer does
            if self.args.mode == "accumulate":
                if self.long_seen:
                    self.corruption += 1
                if prompt_tokens > self.args.long_tokens:
                    self.long_seen = True
            return self.corruption

    def skew(self, pos: int) -> float:
        """``skew`` mode: logprobs with a context past ``--long-tokens`` are 1.5 nats off (a wrong merge)."""
        return 1.5 if self.args.mode == "skew" and pos > self.args.long_tokens else 0.0

    def on_output(self, output_tokens: int) -> None:
        if not self.args.spec_tokens:
            return
        curve = COLLAPSED_ACCEPTANCE if self.args.mode == "collapse" else HEALTHY_ACCEPTANCE
        curve = (curve + [curve[-1]] * self.args.spec_tokens)[: self.args.spec_tokens]
        with self.lock:
            drafts = max(1, math.ceil(output_tokens / (1 + sum(curve))))
            self.drafts += drafts
            self.draft_tokens += drafts * self.args.spec_tokens
            for pos, rate in enumerate(curve):
                self.accepted[pos] += rate * drafts


def _token_lp(prev: int, pos: int, tok: int) -> float:
    """The stand-in model's logprob of ``tok`` at ``pos`` after ``prev``: deterministic, in (-9, 0)."""
    return -(((tok * 31 + pos * 17 + prev * 7) % 89) / 10.0) - 0.05


def _norm(text: str) -> str:
    return " ".join(text.split())


def _numbers(upto: int, start: int = 1) -> list[str]:
    return [str(i) for i in range(start, upto + 1)]


def answer(state: State, prompt: str, max_tokens: int, ignore_eos: bool, level: int) -> str:
    """The stand-in's 'model': a right answer, made wrong according to mode and corruption."""
    mode = state.args.mode
    long_prompt = count_tokens(prompt) > state.args.long_tokens
    looping = mode == "repetition" and long_prompt
    tail = prompt.strip().splitlines()[-1] if prompt.strip() else ""

    if "Question:" in prompt and prompt.rstrip().endswith("Answer:"):
        question = prompt.rsplit("Question:", 1)[1].rsplit("Answer:", 1)[0]
        solution = state.gsm8k.get(_norm(question))
        if solution is None:
            return " I do not know.\n#### 0"
        if level or looping:
            final = int(float(solution.rsplit("####", 1)[1].strip()))
            return f" {solution.rsplit('####', 1)[0]}#### {final + 13 + level}"
        return " " + solution

    if m := re.search(r"count from (\d+) to (\d+)", tail, re.IGNORECASE):
        start, stop = int(m.group(1)), int(m.group(2))
        numbers = _numbers(stop, start)
        if looping:
            numbers = numbers[:20] + ["21", "22", "23"] * 200
        elif level:
            numbers = numbers[:30] + numbers[30 + level:]
        return " ".join(numbers[:max_tokens])

    if m := re.search(r"(\d+)\s*\+\s*(\d+)", tail):
        a, b = int(m.group(1)), int(m.group(2))
        text = f"{a} + {b} = {a + b + level}."
        return _loop(text, max_tokens) if looping else text

    if re.search(r"translate.*hello.*french", tail, re.IGNORECASE):
        return "Bonjour." if not level else "Bon... the the jour jour."

    if "secret code" in tail.lower():
        m = re.search(r"secret code is (\d+)", prompt)
        code = int(m.group(1)) if m else 0
        text = f"The secret code is {code + level}."
        return _loop(text, max_tokens) if looping else text

    if ignore_eos:
        return " ".join(f"w{i % 97}" for i in range(max_tokens))
    return "OK."


def _loop(text: str, max_tokens: int) -> str:
    loop = " and so the answer is the answer is the answer is"
    words = (text + loop * max_tokens).split()
    return " ".join(words[:max_tokens])


class Handler(BaseHTTPRequestHandler):
    """One request: route by path, answer JSON (or SSE when streaming)."""

    state: State
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        sys.stderr.write(f"standin: {format % args}\n")

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self._write(body)

    def _write(self, data: bytes) -> None:
        """Write (part of) a reply; with ``--trickle`` a POST reply goes one byte every S seconds."""
        if not (self.command == "POST" and self.state.args.trickle):
            self.wfile.write(data)
            return
        for i in range(len(data)):
            self.wfile.write(data[i:i + 1])
            self.wfile.flush()
            time.sleep(self.state.args.trickle)

    def _json(self, code: int, obj: object) -> None:
        self._send(code, json.dumps(obj).encode())

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": self.state.args.model_name, "object": "model", "owned_by": "standin"}]})
        elif self.path == "/metrics":
            self._send(200, self._metrics().encode(), "text/plain; version=0.0.4")
        else:
            self._json(404, {"error": f"no route {self.path}"})

    def _metrics(self) -> str:
        # Written by prometheus_client itself, as vLLM's /metrics is: "# TYPE x_total counter".
        st = self.state
        registry = prometheus_client.CollectorRegistry()
        labels = ["engine", "model_name"]
        running = prometheus_client.Gauge("vllm:num_requests_running",
                                          "Number of requests in model execution batches.", labels,
                                          registry=registry)
        running.labels("0", st.args.model_name).set(0)
        itl = prometheus_client.Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency "
                                          "in seconds.", labels, registry=registry,
                                          buckets=[0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0])
        with st.lock:
            itls = list(st.itls)
        child = itl.labels("0", st.args.model_name)
        for value in itls:
            child.observe(value)
        if st.args.spec_tokens:
            with st.lock:
                values = [("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", st.drafts),
                          ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", st.draft_tokens)]
                accepted = list(st.accepted)
            for name, doc, value in values:
                counter = prometheus_client.Counter(name, doc, labels, registry=registry)
                counter.labels("0", st.args.model_name).inc(value)
            per_pos = prometheus_client.Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                                "Accepted tokens per draft position.", [*labels, "position"],
                                                registry=registry)
            for pos, value in enumerate(accepted):
                per_pos.labels("0", st.args.model_name, str(pos)).inc(value)
        return prometheus_client.generate_latest(registry).decode()

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            req = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            self._json(400, {"error": "bad json"})
            return
        with self.state.lock:
            self.state.posts += 1
            limited = self.state.posts <= self.state.args.rate_limit
        if limited:
            body = json.dumps({"error": {"message": "rate limit exceeded", "code": 429}}).encode()
            self.send_response(429)
            self.send_header("Content-Type", "application/json")
            self.send_header("Retry-After", f"{self.state.args.retry_after:g}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path == "/v1/completions":
            prompt = req.get("prompt", "")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                self._token_completion(req, prompt)
                return
            if isinstance(prompt, list):
                prompt = prompt[0]
            chat = False
        elif self.path == "/v1/chat/completions":
            prompt = "\n".join(str(m.get("content", "")) for m in req.get("messages", []))
            chat = True
        else:
            self._json(404, {"error": f"no route {self.path}"})
            return
        if req.get("model") != self.state.args.model_name:
            self._json(404, {"error": f"model {req.get('model')!r} does not exist"})
            return
        prompt_tokens = count_tokens(prompt)
        if self.state.args.mode == "dies" and prompt_tokens > self.state.args.capacity:
            sys.stderr.write("standin: RuntimeError: token count exceeds symmetric buffer capacity\n")
            sys.stderr.flush()
            os._exit(1)
        level = self.state.on_request(prompt_tokens)
        max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
        text = answer(self.state, prompt, max_tokens, bool(req.get("ignore_eos")), level)
        for stop in req.get("stop") or []:
            if stop and stop in text:
                text = text.split(stop, 1)[0]
        completion_tokens = max(1, count_tokens(text))
        self.state.on_output(completion_tokens)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        if req.get("stream"):
            if self.state.args.stream_status:
                self._json(self.state.args.stream_status, {"error": {"message": "stream failed", "code": 500}})
                return
            self._stream(text, usage, req)
            return
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
        self._json(200, {"id": "cmpl-standin", "object": "chat.completion" if chat else "text_completion",
                         "model": self.state.args.model_name, "choices": [choice], "usage": usage})

    def _token_completion(self, req: dict[str, object], ids: list[int]) -> None:
        """A token-id prompt with logprobs, answered the way vLLM's completions API does (differential)."""
        st = self.state
        if req.get("model") != st.args.model_name:
            self._json(404, {"error": f"model {req.get('model')!r} does not exist"})
            return
        if st.args.mode == "dies" and len(ids) > st.args.capacity:
            sys.stderr.write("standin: RuntimeError: token count exceeds symmetric buffer capacity\n")
            sys.stderr.flush()
            os._exit(1)
        st.on_request(len(ids))
        max_tokens = int(req.get("max_tokens") or 16)  # type: ignore[call-overload]
        k = int(req.get("logprobs") or 0)  # type: ignore[call-overload]
        seq = list(ids)
        tokens: list[int] = []
        top: list[dict[str, float]] = []
        for _ in range(max_tokens):
            pos = len(seq)
            best = (seq[-1] * 5 + pos * 3) % 256
            row = {best: -0.05} | {(best + i) % 256: -0.5 - 0.5 * i for i in range(1, max(k, 1))}
            top.append({f"token_id:{t}": lp + st.skew(pos) for t, lp in row.items()})
            tokens.append(best)
            seq.append(best)
        prompt_lp: list[object] = [None] + [
            {str(ids[p]): {"logprob": _token_lp(ids[p - 1], p, ids[p]) + st.skew(p), "rank": 1,
                           "decoded_token": f"<{ids[p]}>"}} for p in range(1, len(ids))]
        choice = {"index": 0, "text": "", "finish_reason": "length", "token_ids": tokens,
                  "prompt_token_ids": ids, "prompt_logprobs": prompt_lp if req.get("prompt_logprobs") else None,
                  "logprobs": {"tokens": [f"token_id:{t}" for t in tokens],
                               "token_logprobs": [r[f"token_id:{t}"] for r, t in zip(top, tokens, strict=True)],
                               "top_logprobs": top, "text_offset": [0] * len(tokens)} if k else None}
        st.on_output(len(tokens))
        if req.get("stream"):
            self._stream_tokens(tokens, len(ids), req)
            return
        choices = _fault(st.args.reply_fault, choice)
        self._json(200, {"id": "cmpl-standin", "object": "text_completion", "model": st.args.model_name,
                         "choices": choices, "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                                                       "total_tokens": len(ids) + len(tokens)}})

    def _stream_tokens(self, tokens: list[int], prompt_tokens: int, req: dict[str, object]) -> None:
        """A token-id prompt streamed as vLLM streams it: one chunk per token (``--ttft-ms``, then
        ``--tpot-ms`` apart), ``token_ids`` with ``return_token_ids``, the cumulative usage on every
        chunk with ``stream_options.continuous_usage_stats``, a final usage chunk with ``include_usage``."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        options = req.get("stream_options")
        options = options if isinstance(options, dict) else {}
        include_usage = bool(options.get("include_usage"))
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
        time.sleep(self.state.args.ttft_ms / 1000)
        last = 0.0
        for i, tok in enumerate(tokens):
            if i:
                time.sleep(self.state.args.tpot_ms / 1000)
                with self.state.lock:
                    self.state.itls.append(time.perf_counter() - last)
            last = time.perf_counter()
            choice: dict[str, object] = {"index": 0, "text": bytes([tok]).decode("latin-1"),
                                         "finish_reason": "length" if i == len(tokens) - 1 else None}
            if req.get("return_token_ids"):
                choice["token_ids"] = [tok]
            chunk: dict[str, object] = {"id": "cmpl-standin", "object": "text_completion",
                                        "model": self.state.args.model_name, "choices": [choice]}
            if continuous:
                chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": i + 1,
                                  "total_tokens": prompt_tokens + i + 1}
            self._write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())
            self.wfile.flush()
        if include_usage:
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                     "total_tokens": prompt_tokens + len(tokens)}
            tail = {"id": "cmpl-standin", "object": "text_completion", "choices": [], "usage": usage}
            self._write(f"data: {json.dumps(tail)}\n\n".encode())
        self._write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _stream(self, text: str, usage: dict[str, int], req: dict[str, object]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        time.sleep(self.state.args.ttft_ms / 1000)
        pieces = re.findall(r"\s*\S+", text)
        for i, piece in enumerate(pieces):
            if i:
                time.sleep(self.state.args.tpot_ms / 1000)
            chunk = {"id": "cmpl-standin", "object": "text_completion", "model": self.state.args.model_name,
                     "choices": [{"index": 0, "text": piece, "finish_reason": None}]}
            self._write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())
            self.wfile.flush()
        options = req.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            tail = {"id": "cmpl-standin", "object": "text_completion", "choices": [], "usage": usage}
            self._write(f"data: {json.dumps(tail)}\n\n".encode())
        self._write(b"data: [DONE]\n\n")
        self.wfile.flush()


def _fault(fault: str | None, choice: dict[str, object]) -> list[object]:
    """A token-id reply broken on purpose (``--reply-fault``): a reference server gone wrong."""
    if fault is None:
        return [choice]
    if fault == "no-choices":
        return []
    lp = choice["logprobs"]
    assert isinstance(lp, dict)
    if fault == "short-prompt-logprobs":
        rows = choice["prompt_logprobs"]
        assert isinstance(rows, list)
        choice["prompt_logprobs"] = rows[: len(rows) // 2]
    elif fault == "top-logprobs-lists":
        lp["top_logprobs"] = [list(row.items()) for row in lp["top_logprobs"]]
    elif fault == "short-tokens":  # 3 tokens whatever max_tokens asked
        tokens = choice["token_ids"]
        assert isinstance(tokens, list)
        choice["token_ids"] = tokens[:3]
        lp["tokens"], lp["top_logprobs"] = lp["tokens"][:3], lp["top_logprobs"][:3]
    return [choice]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", default="healthy",
                   choices=["healthy", "repetition", "accumulate", "collapse", "dies", "skew"])
    p.add_argument("--model-name", default="standin")
    p.add_argument("--gsm8k", help="folder with train.jsonl and test.jsonl (GSM8K format)")
    p.add_argument("--spec-tokens", type=int, default=5, help="MTP draft positions in /metrics (0: none)")
    p.add_argument("--long-tokens", type=int, default=2048, help="prompts longer than this loop (repetition)")
    p.add_argument("--capacity", type=int, default=1408, help="prompts longer than this kill it (dies)")
    p.add_argument("--start-delay", type=float, default=0.0, help="seconds before the port is bound")
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--tpot-ms", type=float, default=0.5)
    p.add_argument("--die-after", type=int, default=0, help="SIGKILL itself on request N + 1 (0: never)")
    p.add_argument("--trickle", type=float, default=0.0, help="POST reply bodies one byte every S seconds")
    p.add_argument("--rate-limit", type=int, default=0, help="answer the first N POST requests 429")
    p.add_argument("--stream-status", type=int, default=0, help="answer every streamed request with this HTTP "
                                                                "status and a JSON error (0: stream)")
    p.add_argument("--retry-after", type=float, default=1.0, help="the 429s' Retry-After, seconds")
    p.add_argument("--reply-fault", choices=["no-choices", "short-prompt-logprobs", "top-logprobs-lists",
                                             "short-tokens"], help="token-id replies broken so (a bad reference)")
    args = p.parse_args(argv)
    state = State(args)
    time.sleep(args.start_delay)
    handler = type("BoundHandler", (Handler,), {"state": state})
    server = ThreadingHTTPServer((args.host, args.port), handler)
    server.daemon_threads = True
    sys.stderr.write(f"standin: mode {args.mode} on http://{args.host}:{args.port}\n")
    sys.stderr.flush()
    server.serve_forever()


if __name__ == "__main__":
    main()
