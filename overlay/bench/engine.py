"""``make bench-engine``: engine-level A/B of ``VLLM_DCP_PROJECT_BEFORE_MERGE`` on real ``vllm serve`` servers.

Two servers of the generated tiny GLM-5 checkpoint (``overlay.engine.checkpoint``) run at once on the
same GPUs, identical but for one variable: A with ``VLLM_DCP_PROJECT_BEFORE_MERGE=1`` (our
dcp-project-before-merge), B with ``=0`` (vLLM 0.28.0's merge-then-project order). Both serve at
TP ``--tp`` x DCP ``--dcp`` over ``--transport`` (``direct``: ``--dcp-comm-backend a2a`` with
``VLLM_USE_DIRECT_DCP_A2A=1``; ``a2a``: the same on NCCL; ``ag_rs``), ``fp8_ds_mla`` KV cache,
CUDA graphs (``max_cudagraph_capture_size`` ``--max-cudagraph-capture-size``), prefix caching, no
speculative decoding, a fixed KV cache (``--kv-cache-memory-bytes``; default: the largest cell's
tokens / DCP x layers x (656 B fp8_ds_mla + 132 B indexer) per token and layer, plus a margin), NVLink
multicast off, each its own port, ``VLLM_PORT`` range and ``VLLM_CACHE_ROOT``. The DSA indexer's
logits come from the test-only ``deep_gemm`` stand-in (``tests/engine/standin``, as ``make
engine-check``) unless ``--no-deep-gemm-standin``.

Cells: every ``batch`` of ``--batches`` x ``context`` of ``--contexts`` (or ``--cells 1x4096,mixed``).
A cell's ``batch`` requests are streamed ``/v1/completions`` sent at once, each a token-id prompt of
``context`` tokens (seeded random byte tokens 0..255) that shares its first ``context - 32`` tokens
with the others and differs in the last 32, ``max_tokens`` ``--decode-tokens``, ``ignore_eos``,
temperature 0. Before a cell's measured runs each server gets one unmeasured warm-up of the cell (a
single request first, so the shared prefix is computed once and cached): with prefix caching the
measured runs prefill only the last block or two of each prompt, and the time is decode's (the
servers run with ``--enable-prompt-tokens-details``: a cell whose measured runs got less than 90% of
their prompt tokens from the cache is flagged). The
``mixed`` cell: ``--mixed-batch`` decode requests at ``--mixed-context`` (shared prefix, as above)
while a fresh ``--mixed-context``-token prompt (never seen by that server, ``max_tokens`` 1) arrives
every ``--mixed-interval`` seconds until the decodes finish: chunked prefill beside decode, which runs
attention outside the full CUDA graphs.

Measured per request: the arrival time of every streamed chunk and how many tokens it brought
(``stream_options`` ``include_usage`` + ``continuous_usage_stats``: each chunk carries the cumulative
``completion_tokens``). Definitions, per run:

- TPOT of a request = (arrival of its last token - arrival of its first token) / (tokens - 1);
  the run's TPOT is the mean over its (decode) requests.
- decode throughput = the tokens that arrive in the window where every request is decoding,
  (latest first-token arrival, earliest last-token arrival], summed over the requests, divided by
  the window's length: the steady full-batch rate, prefill and the stragglers' ends left out. Where
  that window is empty (one token per request) it falls back to sum(tokens - 1) / (latest last-token
  arrival - earliest first-token arrival).
- mixed cell: decode throughput of the decode requests as above; total throughput = (those
  tokens + the prompt tokens of the prefills answered inside the window) / the window.

Also per run: the median ITL, the median of the gaps before single-token chunks after each request's
first, pooled over the requests (one decode step; the prefill of the requests' last tokens and other
stalls, which move the mean, left out), and the share of chunks that brought one token (below 0.9 the
client or the server's output path bundled tokens and its gaps are not step times). Besides the
client's clock, each run reads vLLM's own inter-token latency histogram
(``vllm:inter_token_latency_seconds``, ``/metrics`` before and after the run): the server's mean ITL.

The twin (default; ``--no-twin`` leaves it out): a third server C, identical to A (the flag on too),
measured in the same rounds. A against C on the judged metric is the null of the same run, at no extra
start-up: where the twins differ by more than the target allows (interval without 1, ratio beyond 0.98
or 1 / 0.98) the cell's verdict is ``not readable``.

Order: per cell, warm-up of each server, then measured rounds, one server at a time while the others
idle: A B, B A, ... (ABBA), or with the twin ABC, BCA, CAB, CBA, BAC, ACB, ... (each server as often
first, second and last): at least ``--repeats`` per server, and rounds are added until each
server's measured runs of the cell took ``--cell-seconds`` (up to ``--max-repeats``): a 0.3 s run at
batch 1 gets ~30 rounds, a 5 s run at batch 64 the minimum. The stop depends on elapsed time only, not on
the values. Per cell: median of the runs of each server; ratios > 1 when A (the optimization) is
faster (B / A for times, A / B for tok/s). Each cell is judged on one metric: decode cells on the median
ITL when the client kept up in every run, else on server ITL when both servers report it, else TPOT; the
mixed cell on server ITL (its prefill steps are the point), else TPOT. The judged ratio gets a 95%
percentile-bootstrap interval over the ABBA pairs (run k of A and run k of B resampled together, so slow
drift of the machine cancels) and a verdict against the issue's 0.98: ``faster`` (the interval above 1),
``meets target`` (at or above 0.98), ``below target`` or ``inconclusive`` (it spans 0.98); a point ratio
below 0.98 is flagged as well. A server can stay slower than its identical twin for a whole cell (one
H200, TP 1, 2026-12-01: 1x16384 A/A 1.37, interval 1.11-1.40), which no interval over one pair of
servers can see: hence the twin. ``--null`` runs B with the flag on too (A/A/A): every ratio is then
noise. ``--reanalyze engine.json`` recomputes an earlier run's summaries and cells from its raw
chunk arrivals with these definitions.

Writes ``engine.json`` (settings, versions, every run's raw numbers, per-cell medians and ratios;
rewritten after every cell, ``partial`` until the end), ``engine.md`` (the table) and ``engine.png``
(matplotlib Agg; ``--plot engine.json`` redraws the table and plot of an earlier run, e.g. where the
GPU machine lacks matplotlib); the servers' logs are ``server-A.log`` and ``server-B.log``.
``--budget S`` starts no cell that would not end within S seconds of the start (estimated from the
cells so far) and marks the result partial. A server that dies stops the run with one line naming
it and its log's telling line (exit 1); what was measured is written first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import EventSource

from overlay.atomic import write_file
from overlay.engine.check import PORT_BASE, PORT_STRIDE, REPO, SAFE_ENV, STANDIN, error_line
from overlay.regress.server import Server

PREFIX = "[bench-engine]"
TARGET = 0.98
TAIL_TOKENS = 32  # the part of a prompt that differs between a cell's requests
FP8_DS_MLA_BYTES = 656  # per token and layer: 512 fp8 latent + 4 x fp32 scales + 64 bf16 rope
INDEXER_BYTES = 132  # per token and layer: 128 fp8 indexer key + its fp32 scale
MODEL_LEN_MARGIN = 64
CACHED_MIN = 0.9  # a measured run whose prompts the prefix cache served less than this is flagged
KEPT_UP_MIN = 0.9  # below this share of single-token chunks the client's gaps are not step times
CONFIDENCE = 0.95
BOOTSTRAP_SAMPLES = 2000
MIN_PAIRS = 3  # fewer ABBA pairs than this give no interval
# What a cell's runs can be judged on, best first: summary key -> (label, lower is better).
METRICS: dict[str, tuple[str, bool]] = {
    "itl_median_ms": ("median ITL", True),
    "server_itl_ms": ("server ITL", True),
    "tpot_ms": ("TPOT", True),
    "decode_tok_s": ("tok/s", False),
}
METRIC_RATIO = {"itl_median_ms": "itl_median_ratio", "server_itl_ms": "server_itl_ratio",
                "tpot_ms": "tpot_ratio", "decode_tok_s": "tok_s_ratio"}  # where each metric's ratio is kept
DEFINITIONS: dict[str, str] = {
    "tpot": "per request (last token arrival - first token arrival) / (tokens - 1), mean over requests",
    "decode_tok_s": "tokens arriving in (latest first-token arrival, earliest last-token arrival] "
                    "over all requests / that window",
    "total_tok_s": "mixed: (decode tokens in the window + prompt tokens of prefills answered in it) / window",
    "tpot_ratio": "median TPOT B / median TPOT A (>1: A faster)",
    "tok_s_ratio": "median decode tok/s A / B (>1: A faster)",
    "server_itl_ms": "vllm:inter_token_latency_seconds sum / count between /metrics scrapes before and "
                     "after the run (the server's timestamps; every token after each request's first)",
    "server_itl_ratio": "median server ITL B / A (>1: A faster)",
    "itl_median_ms": "median of the gaps before single-token chunks (after each request's first), pooled "
                     "over the run's decode requests: one decode step, prefill steps and stalls left out",
    "itl_median_ratio": "median of the runs' median ITL, B / A (>1: A faster)",
    "single_token_chunks": "share of chunks after each request's first that brought one token",
    "judged": "decode cells: itl_median_ms when every run's single_token_chunks >= "
              f"{KEPT_UP_MIN}; else server_itl_ms when both servers report it; else tpot_ms. "
              "mixed: server_itl_ms, else tpot_ms",
    "judged_interval": f"{CONFIDENCE:.0%} percentile bootstrap ({BOOTSTRAP_SAMPLES} resamples of the "
                       "ABBA pairs) of the judged ratio",
    "verdict": f"faster: interval above 1; meets target: interval at or above {TARGET}; below target: "
               f"interval below {TARGET}; inconclusive: it spans {TARGET}; not readable: the twins differ",
    "twin_ratio": "the judged metric, twin C (identical to A: flag on) against A, ratio of medians (> 1: A faster)",
    "twin_interval": "its bootstrap interval over the rounds (run k of A with run k of C)",
    "twins_differ": f"twin_interval leaves out 1 and twin_ratio lies outside [{TARGET}, 1 / {TARGET}]",
}
SERVED_NAME = "tiny-glm5"
SIDES = {"A": "1", "B": "0"}  # VLLM_DCP_PROJECT_BEFORE_MERGE per server
TWIN = "C"  # a third server, A's twin (flag on too): A against C is the run's own null
FLAGS = {**SIDES, TWIN: "1"}
# The measured runs' order, a round per pair (two servers) or triple (with the twin): with three, the
# six orders in turn, so each server is as often first, second and last, and after each of the others.
ORDERS = {2: (("A", "B"), ("B", "A")),
          3: (("A", "B", "C"), ("B", "C", "A"), ("C", "A", "B"), ("C", "B", "A"), ("B", "A", "C"), ("A", "C", "B"))}
TRANSPORTS = ("direct", "a2a", "ag_rs")
DEFAULT_VLLM = "python3 -m vllm.entrypoints.cli.main"


class BenchError(Exception):
    """The run cannot go on (a server died, a request failed); the message is one line."""


# ---------------------------------------------------------------------------------------------- cells


@dataclass(frozen=True)
class Cell:
    """One measured configuration: ``batch`` requests of ``context`` tokens, or the mixed load."""

    batch: int
    context: int
    mixed: bool = False

    @property
    def name(self) -> str:
        return "mixed" if self.mixed else f"{self.batch}x{self.context}"


def parse_cells(spec: str | None, batches: list[int], contexts: list[int], *, mixed_batch: int,
                mixed_context: int, mixed: bool = True) -> list[Cell]:
    """The cells to run: ``batches`` x ``contexts`` smallest context first (mixed after the cells of
    its context), or ``spec`` (``--cells``: ``1x4096,8x16384,mixed``) in the order given (under
    ``--budget`` the first ones are the ones that run).
    """
    cells: list[Cell] = []
    if spec:
        for item in filter(None, (s.strip() for s in spec.split(","))):
            if item == "mixed":
                cells.append(Cell(mixed_batch, mixed_context, mixed=True))
                continue
            m = re.fullmatch(r"(\d+)x(\d+)", item)
            if not m or int(m.group(1)) < 1 or int(m.group(2)) <= TAIL_TOKENS:
                raise ValueError(f"--cells: {item!r} is not BATCHxCONTEXT (context > {TAIL_TOKENS}) or 'mixed'")
            cells.append(Cell(int(m.group(1)), int(m.group(2))))
    else:
        for b in batches:
            for c in contexts:
                if b < 1 or c <= TAIL_TOKENS:
                    raise ValueError(f"batch {b} x context {c}: want batch >= 1 and context > {TAIL_TOKENS}")
        cells = [Cell(b, c) for c in contexts for b in batches]
        if mixed:
            cells.append(Cell(mixed_batch, mixed_context, mixed=True))
    if len({c.name for c in cells}) != len(cells):
        raise ValueError("--cells: a cell is named twice")
    if spec:
        return cells
    return sorted(cells, key=lambda c: (c.context, c.mixed, c.batch))


def round_order(k: int, servers: int = 2) -> tuple[str, ...]:
    """The order of round ``k``'s runs: AB, BA, AB, ... for two servers; ABC, BCA, CAB, CBA, BAC, ACB, ...
    with the twin."""
    orders = ORDERS[servers]
    return orders[k % len(orders)]


def abba(repeats: int, servers: int = 2) -> list[str]:
    """The measured runs' order: ``repeats`` rounds (runs per server) of ``round_order``."""
    return [side for k in range(repeats) for side in round_order(k, servers)]


def cell_prompts(cell: Cell, seed: int) -> list[list[int]]:
    """``cell.batch`` prompts of ``cell.context`` byte tokens: one shared prefix, 32 own tokens each."""
    rng = random.Random(f"bench-engine:{seed}:{cell.context}:{cell.batch}:{cell.mixed}")
    prefix = [rng.randrange(256) for _ in range(cell.context - TAIL_TOKENS)]
    return [prefix + [rng.randrange(256) for _ in range(TAIL_TOKENS)] for _ in range(cell.batch)]


def fresh_prompt(context: int, seed: int, tag: str) -> list[int]:
    """A prompt no other request shares (the mixed cell's arriving prefills)."""
    rng = random.Random(f"bench-engine:fresh:{seed}:{tag}")
    return [rng.randrange(256) for _ in range(context)]


# -------------------------------------------------------------------------------------------- metrics


@dataclass
class Request:
    """One streamed request: chunk arrivals (seconds since the run's start) and tokens per chunk."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    kind: str = "decode"  # decode | prefill (mixed cell)
    cached_tokens: int | None = None  # prompt tokens the prefix cache served (usage.prompt_tokens_details)

    @property
    def total(self) -> int:
        return sum(self.tokens)

    @property
    def first(self) -> float:
        return self.arrivals[0]

    @property
    def last(self) -> float:
        return self.arrivals[-1]

    def tpot(self) -> float | None:
        return (self.last - self.first) / (self.total - 1) if self.arrivals and self.total > 1 else None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "sent": round(self.sent, 6), "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "arrivals": [round(t, 6) for t in self.arrivals],
                "tokens": self.tokens}


def summarize(requests: list[Request]) -> dict[str, Any]:
    """A run's numbers from its requests (definitions in the module docstring)."""
    dec = [r for r in requests if r.kind == "decode" and r.arrivals]
    tpots = [t for t in (r.tpot() for r in dec) if t is not None]
    out: dict[str, Any] = {"requests": len(dec), "tokens": sum(r.total for r in dec)}
    if dec and all(r.cached_tokens is not None for r in dec):
        out["cached_fraction"] = sum(r.cached_tokens or 0 for r in dec) / max(1, sum(r.prompt_tokens for r in dec))
    if not dec or not tpots:
        return out | {"tpot_ms": None, "decode_tok_s": None}
    t0, t1 = max(r.first for r in dec), min(r.last for r in dec)
    in_window = sum(n for r in dec for t, n in zip(r.arrivals, r.tokens, strict=True) if t0 < t <= t1)
    if t1 > t0 and in_window:
        window, tokens, how = t1 - t0, in_window, "full-batch window"
    else:
        t0, t1 = min(r.first for r in dec), max(r.last for r in dec)
        window, tokens, how = t1 - t0, sum(r.total - 1 for r in dec), "first-to-last fallback"
    steady = steady_intervals(dec)
    out |= {
        "itl_median_ms": 1000.0 * statistics.median(steady) if steady else None,
        "single_token_chunks": single_token_share(dec),
        "tpot_ms": 1000.0 * statistics.fmean(tpots),
        "tpot_ms_max": 1000.0 * max(tpots),
        "ttft_ms_mean": 1000.0 * statistics.fmean(r.first - r.sent for r in dec),
        "first_token_spread_ms": 1000.0 * (max(r.first for r in dec) - min(r.first for r in dec)),
        "decode_tok_s": tokens / window if window > 0 else None,
        "window_s": window, "window_tokens": tokens, "throughput_window": how,
        "wall_s": max(r.last for r in dec) - min(r.sent for r in dec),
    }
    pre = [r for r in requests if r.kind == "prefill"]
    if pre:
        done = [r for r in pre if r.arrivals and t0 < r.first <= t1]
        out |= {"prefills_sent": len(pre), "prefills_in_window": len(done),
                "total_tok_s": (tokens + sum(r.prompt_tokens for r in done)) / window if window > 0 else None}
    return out


def steady_intervals(requests: list[Request]) -> list[float]:
    """The gaps before every chunk that brought one token, after each request's first, pooled over the
    requests: one decode step each. A gap before a chunk of several tokens spans several steps and
    is left out."""
    return [t - prev for r in requests for prev, t, n in zip(r.arrivals, r.arrivals[1:], r.tokens[1:], strict=False)
            if n == 1]


def single_token_share(requests: list[Request]) -> float | None:
    """Of the chunks after each request's first, the share that brought one token: 1.0 when the client
    (and the server's output path) kept up with every decode step; low when tokens came bundled, and the
    client's intervals are then not step times."""
    later = [n for r in requests for n in r.tokens[1:]]
    return sum(1 for n in later if n == 1) / len(later) if later else None


def median_or_none(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def ratio_of_medians(a: list[float | None], b: list[float | None], lower_is_better: bool) -> float | None:
    """> 1 when A (the optimization) is faster: median B / median A for times, A / B for rates."""
    ma, mb = median_or_none(a), median_or_none(b)
    if not ma or not mb:
        return None
    return mb / ma if lower_is_better else ma / mb


def ratio_interval(a: list[float | None], b: list[float | None], lower_is_better: bool,
                   seed: str = "") -> list[float] | None:
    """A ``CONFIDENCE`` percentile-bootstrap interval of ``ratio_of_medians``: ABBA pairs (run k of A
    with run k of B, adjacent in time) resampled together, so slow drift of the machine cancels;
    seeded, so the same runs give the same interval. None below ``MIN_PAIRS`` pairs."""
    pairs = [(va, vb) for va, vb in zip(a, b, strict=False) if va and vb]
    if len(pairs) < MIN_PAIRS:
        return None
    rng = random.Random(f"bench-engine:interval:{seed}")
    n = len(pairs)
    stats = []
    for _ in range(BOOTSTRAP_SAMPLES):
        pick = [pairs[rng.randrange(n)] for _ in range(n)]
        ma, mb = statistics.median(p[0] for p in pick), statistics.median(p[1] for p in pick)
        stats.append(mb / ma if lower_is_better else ma / mb)
    stats.sort()
    tail = (1.0 - CONFIDENCE) / 2
    return [stats[int(tail * BOOTSTRAP_SAMPLES)], stats[int((1.0 - tail) * BOOTSTRAP_SAMPLES) - 1]]


def verdict(ratio: float | None, interval: list[float] | None, target: float = TARGET) -> str:
    """What the runs say about a cell against ``target``, from the ratio's interval (not its point):
    ``faster`` (all of it above 1), ``meets target`` (all of it at or above the target), ``below target``
    (all of it below), ``inconclusive`` (it spans the target: more runs, or a quieter machine)."""
    if ratio is None:
        return "no ratio"
    if interval is None:
        return f"too few runs (< {MIN_PAIRS} pairs)"
    lo, hi = interval
    if lo > 1.0:
        return "faster"
    if lo >= target:
        return "meets target"
    if hi < target:
        return "below target"
    return "inconclusive"


def twins_differ(ratio: float | None, interval: list[float] | None, target: float = TARGET) -> bool:
    """Whether A and its identical twin C differ by more than the target allows: the interval leaves out
    1 and the ratio itself is beyond the target's margin either way (below ``target`` or above
    ``1 / target``). A tiny but certain difference (1.003, interval 1.001 - 1.005) keeps the cell readable."""
    if ratio is None or interval is None:
        return False
    certain = interval[0] > 1.0 or interval[1] < 1.0
    return certain and not target <= ratio <= 1.0 / target


def judged_metric(a: dict[str, Any], b: dict[str, Any], runs: list[dict[str, Any]], mixed: bool) -> str:
    """The metric a cell is judged on. Decode cells: the median gap between single-token chunks (one
    decode step; the prefill of the requests' last tokens and other stalls left out) when the client
    kept up in every run; else vLLM's own mean inter-token latency when both servers report it; else
    TPOT. The mixed cell is about steps that carry prefill too: server ITL (every step), else TPOT."""
    shares = [r["summary"].get("single_token_chunks") for r in runs if not r.get("warmup")]
    kept_up = bool(shares) and all(x is not None and x >= KEPT_UP_MIN for x in shares)
    if not mixed and kept_up and a.get("itl_median_ms") and b.get("itl_median_ms"):
        return "itl_median_ms"
    if a.get("server_itl_ms") and b.get("server_itl_ms"):
        return "server_itl_ms"
    return "tpot_ms"


def cell_summary(runs: list[dict[str, Any]], expect_cached: bool = True, mixed: bool = False,
                 name: str = "") -> dict[str, Any]:
    """Per-server medians of a cell's measured runs, the ratios (> 1: A, the optimization, is faster),
    the judged metric's interval and verdict; with the twin's runs, A against its twin C on the judged
    metric (``twin_ratio``, ``twin_interval``) and a verdict of ``not readable`` when they differ
    (``twins_differ``): then the A/B of this cell says nothing at the target's precision."""
    out: dict[str, Any] = {}
    sides = [*SIDES, *([TWIN] if any(r["server"] == TWIN for r in runs) else [])]
    for side in sides:
        mine = [r["summary"] for r in runs if r["server"] == side and not r.get("warmup")]
        out[side] = {key: median_or_none([s.get(key) for s in mine])
                     for key in ("tpot_ms", "decode_tok_s", "total_tok_s", "server_itl_ms", "itl_median_ms")}
        out[side]["runs"] = len(mine)
        for key in METRICS:
            out[side][f"{key}_runs"] = [s.get(key) for s in mine]
    a, b = out["A"], out["B"]
    for key, (_label, lower) in METRICS.items():
        ratio_key = METRIC_RATIO[key]
        out[ratio_key] = ratio_of_medians(a[f"{key}_runs"], b[f"{key}_runs"], lower)
        # Run k of A beside run k of B (adjacent in ABBA): the spread of these is the cell's noise.
        pairs = [(vb / va if lower else va / vb) for va, vb in zip(a[f"{key}_runs"], b[f"{key}_runs"], strict=False)
                 if va and vb]
        out[f"{ratio_key}_pairs"] = pairs
        out[f"{ratio_key}_range"] = [min(pairs), max(pairs)] if pairs else None
    out["total_tok_s_ratio"] = (a["total_tok_s"] / b["total_tok_s"]
                                if a["total_tok_s"] and b["total_tok_s"] else None)
    cached = [r["summary"].get("cached_fraction") for r in runs if not r.get("warmup")]
    out["cached_fraction_min"] = min((c for c in cached if c is not None), default=None)
    shares = [r["summary"].get("single_token_chunks") for r in runs if not r.get("warmup")]
    out["single_token_chunks_min"] = min((x for x in shares if x is not None), default=None)
    judged = judged_metric(a, b, runs, mixed)
    out["judged"] = judged
    out["judged_ratio"] = out[METRIC_RATIO[judged]]
    out["judged_interval"] = ratio_interval(a[f"{judged}_runs"], b[f"{judged}_runs"], METRICS[judged][1],
                                            seed=f"{name}:{judged}")
    out["verdict"] = verdict(out["judged_ratio"], out["judged_interval"])
    if TWIN in out:
        lower = METRICS[judged][1]
        c = out[TWIN]
        out["twin_ratio"] = ratio_of_medians(a[f"{judged}_runs"], c[f"{judged}_runs"], lower)
        out["twin_interval"] = ratio_interval(a[f"{judged}_runs"], c[f"{judged}_runs"], lower,
                                              seed=f"{name}:{judged}:twin")
        out["twins_differ"] = twins_differ(out["twin_ratio"], out["twin_interval"])
        if out["twins_differ"]:
            out["verdict"] = f"not readable (twins differ; A/B {out['verdict']})"
    out["flags"] = flags(out, expect_cached=expect_cached)
    return out


def flags(summary: dict[str, Any], target: float = TARGET, expect_cached: bool = True) -> list[str]:
    """What falls short: the judged ratio (and tok/s beside TPOT) below ``target``, a ratio that could not
    be computed, measured runs whose prompts came less than ``CACHED_MIN`` from the prefix cache
    (prefill in the time, prefix caching on), and a client that got tokens bundled."""
    found = []
    judged = summary.get("judged") or "tpot_ms"
    keys = [judged] + (["decode_tok_s"] if judged == "tpot_ms" else [])
    for key in keys:
        label = METRICS[key][0]
        ratio = summary.get(METRIC_RATIO[key])
        if ratio is None:
            found.append(f"no {label} ratio")
        elif ratio < target:
            found.append(f"{label} {ratio:.3f} < {target}")
    cached = summary.get("cached_fraction_min")
    if expect_cached and cached is not None and cached < CACHED_MIN:
        found.append(f"prefix cache served only {cached:.0%} of a run's prompts")
    if summary.get("twins_differ"):
        lo, hi = summary["twin_interval"]
        found.append(f"A and its twin C differ ({summary['twin_ratio']:.3f}, interval {lo:.3f} - {hi:.3f})")
    share = summary.get("single_token_chunks_min")
    if share is not None and share < KEPT_UP_MIN:
        found.append(f"tokens came bundled ({share:.0%} single-token chunks in a run): client gaps are not step times")
    return found


# ------------------------------------------------------------------------------------------- requests


def _body(model: str, prompt: list[int], max_tokens: int) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()


async def _stream(client: httpx.AsyncClient, body: bytes, start: float, req: Request) -> Request:
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
        tasks = [asyncio.create_task(_stream(cl, b, start, r)) for b, r in zip(bodies, reqs, strict=True)]
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
                    extra.append(asyncio.create_task(_stream(cl, body, start, req)))
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
        raise BenchError(_death(server) or f"cell {cell.name}: server {_side(server)}: {cause}") from None


# -------------------------------------------------------------------------------------------- servers


@dataclass
class Settings:
    """Everything the two servers share (and the workload): recorded in ``engine.json``."""

    model: str
    tp: int = 2
    dcp: int = 2
    transport: str = "direct"
    kv_cache_memory_bytes: int = 0
    gpu_memory_utilization: float = 0.3
    max_model_len: int = 0
    max_position_embeddings: int | None = None
    max_num_seqs: int = 0
    max_num_batched_tokens: int | None = None
    prefix_caching: bool = True
    max_cudagraph_capture_size: int = 64
    decode_tokens: int = 128
    repeats: int = 5  # measured runs per server and cell, at least
    cell_seconds: float = 10.0  # more ABBA pairs until each server's measured runs took this long ...
    max_repeats: int = 30  # ... up to this many runs per server
    null: bool = False  # A/A: both servers VLLM_DCP_PROJECT_BEFORE_MERGE=1, the ratios are the method's noise
    twin: bool = True  # a third server C with A's flag: A against C is the null of the same run
    seed: int = 0
    mixed_batch: int = 32
    mixed_context: int = 4096
    mixed_interval: float = 0.2
    layers: int = 0
    deep_gemm_standin: bool = True
    extra_args: list[str] = field(default_factory=list)
    # B runs this vLLM tree (first on its PYTHONPATH) instead of the flag off: A/B of two trees,
    # VLLM_DCP_PROJECT_BEFORE_MERGE=1 on every server (e.g. engine.variants' mtp-as-prefills)
    b_tree: str = ""
    b_label: str = ""

    def server_args(self) -> list[str]:
        args = ["--tensor-parallel-size", str(self.tp), "--decode-context-parallel-size", str(self.dcp),
                "--dcp-comm-backend", "ag_rs" if self.transport == "ag_rs" else "a2a",
                "--kv-cache-dtype", "fp8_ds_mla", "--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes),
                "--gpu-memory-utilization", str(self.gpu_memory_utilization),
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
                "--compilation-config", json.dumps({"max_cudagraph_capture_size": self.max_cudagraph_capture_size}),
                "--seed", str(self.seed), "--enable-prompt-tokens-details"]
        if self.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.max_position_embeddings and self.max_model_len > self.max_position_embeddings:
            # the checkpoint's RoPE table ends at max_position_embeddings; a longer one covers the cells
            args += ["--hf-overrides", json.dumps({"max_position_embeddings": self.max_model_len})]
        return args + list(self.extra_args)

    def sides(self) -> list[str]:
        """The servers of the run: A and B, and A's twin C with ``twin``."""
        return [*SIDES, *([TWIN] if self.twin else [])]

    def env(self, side: str, out: Path) -> dict[str, str]:
        """The environment of server ``side`` (A, B or the twin C): only VLLM_DCP_PROJECT_BEFORE_MERGE
        differs, besides its own port range and compile cache."""
        env = dict(os.environ)
        env.update(SAFE_ENV)
        env["VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"] = "0"
        env["VLLM_DCP_PROJECT_BEFORE_MERGE"] = FLAGS["A"] if self.null or self.b_tree else FLAGS[side]
        if self.transport in ("direct", "a2a"):
            env["VLLM_USE_DIRECT_DCP_A2A"] = "1" if self.transport == "direct" else "0"
        paths = ([str(STANDIN)] if self.deep_gemm_standin else []) + [str(REPO)]
        if self.b_tree and side == "B" and not self.null:
            paths.insert(0, self.b_tree)
        env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
        env.setdefault("PYTHONUNBUFFERED", "1")
        slot = list(FLAGS).index(side)
        env["VLLM_PORT"] = str(PORT_BASE + slot * PORT_STRIDE)
        env["VLLM_CACHE_ROOT"] = str(out.parent / f"{out.name}-cache" / f"server-{side}")
        return env


def comparison(settings: dict[str, Any], short: bool = False) -> str:
    """What A and B differ in, for titles: the projection flag, another vLLM tree, or nothing (null)."""
    if settings.get("null"):
        return "A/A null run" if short else ("A/A null run, both VLLM_DCP_PROJECT_BEFORE_MERGE=1: the ratios are "
                                             "the method's noise")
    if settings.get("b_tree"):
        b = settings.get("b_label") or settings["b_tree"]
        return f"the series vs {b}" if short else f"A = the series vs B = {b} (VLLM_DCP_PROJECT_BEFORE_MERGE=1 on both)"
    return "VLLM_DCP_PROJECT_BEFORE_MERGE 1 vs 0" if short else "VLLM_DCP_PROJECT_BEFORE_MERGE A=1 vs B=0"


def kv_cache_bytes(tokens_per_gpu: int, layers: int) -> int:
    """A KV cache per GPU for ``tokens_per_gpu`` tokens: fp8_ds_mla + indexer bytes, 25% + 256 MiB margin."""
    return int(tokens_per_gpu * layers * (FP8_DS_MLA_BYTES + INDEXER_BYTES) * 1.25) + (256 << 20)


def largest_tokens(cells: list[Cell], decode_tokens: int) -> int:
    """The most tokens a cell keeps in the cache at once (prefix caching off; the mixed cell's
    prefills counted at a few in flight)."""
    per_cell = [(c.batch + (8 if c.mixed else 0)) * (c.context + decode_tokens + 256) for c in cells]
    return max(per_cell, default=0)


def command(template: str | None, vllm: str, settings: Settings, port: int, side: str) -> list[str]:
    """The server's argv: ``vllm serve`` of the checkpoint, or ``--server-cmd`` with its placeholders
    ({port}, {model}, {name}, {side}, {args}: the vLLM arguments, shell-quoted)."""
    if template:
        filled = template.format(port=port, model=shlex.quote(settings.model), name=SERVED_NAME, side=side,
                                 args=shlex.join(settings.server_args()))
        return shlex.split(filled)
    return [*shlex.split(vllm), "serve", settings.model, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", SERVED_NAME, *settings.server_args()]


def launch(side: str, cmd: list[str], env: dict[str, str], log_path: Path, port: int) -> BenchServer:
    """Start one server in its own process group (``Server.stop`` signals the group)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        log.write(("$ " + shlex.join(cmd) + "\n").encode())
        log.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        except FileNotFoundError:
            raise BenchError(f"server {side}: {cmd[0]!r} not found (--vllm / --server-cmd)") from None
    return BenchServer(side, f"http://127.0.0.1:{port}", proc, log_path)


class BenchServer(Server):
    """A launched server that knows which side (A or B) it is."""

    def __init__(self, side: str, base_url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        super().__init__(base_url, SERVED_NAME, proc, log_path)
        self.side = side


def _side(server: Server) -> str:
    return getattr(server, "side", "?")


def _death(server: Server) -> str | None:
    """None while ``server`` lives; else the one-line error naming it and its log's telling line."""
    if server.alive(attempts=2, pause_s=0.5):
        return None
    side = _side(server)
    if server.proc is not None:
        try:
            server.proc.wait(timeout=5.0)  # a crashing server is usually gone within moments
        except subprocess.TimeoutExpired:
            pass
    rc = server.exited()
    how = f"exited with status {rc}" if rc is not None else "stopped answering /health"
    log = server.log_path.read_text(encoding="utf-8", errors="replace") if server.log_path else ""
    return (f"server {side} (VLLM_DCP_PROJECT_BEFORE_MERGE={FLAGS.get(side, '?')}) {how}; "
            f"{server.log_path}: {error_line(log)}")


def stop_all(servers: list[Server], grace_s: float = 15.0) -> None:
    """Stop the servers side by side (SIGTERM to each group, SIGKILL after ``grace_s``)."""
    import threading

    threads = [threading.Thread(target=s.stop, kwargs={"grace_s": grace_s}) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def wait_ready(servers: list[Server], timeout_s: float) -> None:
    """Until every server answers /health and lists the model; a server that exits ends it at once."""
    start = time.monotonic()
    pending = list(servers)
    next_note = start + 30.0
    while pending:
        for server in list(pending):
            if server.exited() is not None:
                raise BenchError(_death(server) or f"server {_side(server)} exited")
            try:
                if server.client.health() and SERVED_NAME in server.client.models():
                    progress(f"server {_side(server)} ready after {time.monotonic() - start:.0f} s")
                    pending.remove(server)
            except httpx.HTTPError:
                pass
        now = time.monotonic()
        if pending and now - start > timeout_s:
            names = ", ".join(_side(s) for s in pending)
            raise BenchError(f"server {names} not ready after {timeout_s:.0f} s (--ready-timeout); "
                             f"{pending[0].log_path}: {error_line(pending[0].log_tail(40))}")
        if pending and now >= next_note:
            progress(f"waiting for server {', '.join(_side(s) for s in pending)} ({now - start:.0f} s)")
            next_note = now + 30.0
        if pending:
            time.sleep(1.0)


# ---------------------------------------------------------------------------------------------- output


def progress(msg: str) -> None:
    print(f"{PREFIX} {msg}", flush=True)


def _fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def _runs_text(s: dict[str, Any]) -> str:
    if s.get("cell_seconds") is None:  # engine.json of a run before adaptive repeats
        return f"{s.get('repeats')} runs per server (ABBA)"
    order = "rounds ABC, BCA, CAB, CBA, BAC, ACB with A's twin C" if s.get("twin") else "ABBA"
    return (f"{s.get('repeats')}-{max(s.get('repeats') or 0, s.get('max_repeats') or 0)} runs per server ({order}; "
            f"rounds added until each server's runs took {s.get('cell_seconds'):g} s)")


def table(result: dict[str, Any]) -> str:
    """``engine.md``: the verdict per cell on its judged metric, then every metric per cell."""
    s = result.get("settings", {})
    what = comparison(s)
    lines = [f"# bench-engine: {what}{' (partial)' if result.get('partial') else ''}",
             "",
             f"TP {s.get('tp')} x DCP {s.get('dcp')}, transport {s.get('transport')}, fp8_ds_mla, "
             f"prefix caching {'on' if s.get('prefix_caching') else 'off'}, CUDA graphs up to "
             f"{s.get('max_cudagraph_capture_size')}, {s.get('decode_tokens')} decode tokens, "
             f"{_runs_text(s)}, medians; {result.get('gpu') or ''}",
             "",
             "Ratios are > 1 when the optimization (A) is faster: B / A for times, A / B for tok/s. Each cell is "
             "judged on one metric: decode cells on the median ITL (the median gap between single-token "
             "chunks: one decode step; the prefill of the requests' last tokens and other stalls left out) "
             "when the client kept up, else on vLLM's own mean inter-token latency (server ITL, ``/metrics`` "
             "before and after each run), else TPOT; the mixed cell on server ITL (its prefill steps count). "
             f"Interval: {CONFIDENCE:.0%} bootstrap over the ABBA pairs. Verdict against {TARGET}: faster "
             f"(interval above 1), meets target (at or above {TARGET}), below target, or inconclusive (the "
             f"interval spans {TARGET}). Pairs: run k of B against run k of A, lowest and highest. Twin: "
             "A against C, a third server identical to A (the flag on too), on the judged metric: the null "
             f"of the same run; where its interval leaves out 1 and it lies beyond {TARGET} or 1 / {TARGET}, "
             "identical servers differed more than the target allows and the cell is not readable.",
             "",
             "| cell | judged on | A ms | B ms | ratio | interval | pairs | twin (C / A) | twin interval | runs "
             "| verdict | flags |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]

    def span(rng: list[float] | None, sep: str = "-") -> str:
        return f"{rng[0]:.3f}{sep}{rng[1]:.3f}" if rng else "-"

    cells = result.get("cells", {})
    for name, c in cells.items():
        a, b = c["A"], c["B"]
        key = c.get("judged") or ("server_itl_ms" if c.get("server_itl_ratio") is not None else "tpot_ms")
        ratio_key = METRIC_RATIO[key]
        lines.append(f"| {name} | {METRICS[key][0]} | {_fmt(a.get(key), '.3f')} | {_fmt(b.get(key), '.3f')} | "
                     f"{_fmt(c.get(ratio_key), '.3f')} | {span(c.get('judged_interval'), ' - ')} | "
                     f"{span(c.get(f'{ratio_key}_range'))} | {_fmt(c.get('twin_ratio'), '.3f')} | "
                     f"{span(c.get('twin_interval'), ' - ')} | "
                     f"{'+'.join(str(c[x]['runs']) for x in FLAGS if x in c)} | "
                     f"{c.get('verdict', '-')} | {'; '.join(c['flags']) or 'ok'} |")
    lines += ["", "Every metric (medians of the runs; ratio > 1: A faster):", "",
              "| cell | A TPOT ms | B TPOT ms | ratio | A median ITL ms | B median ITL ms | ratio | A server ITL ms "
              "| B server ITL ms | ratio | A tok/s | B tok/s | ratio |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, c in cells.items():
        a, b = c["A"], c["B"]
        lines.append(f"| {name} | {_fmt(a.get('tpot_ms'), '.3f')} | {_fmt(b.get('tpot_ms'), '.3f')} | "
                     f"{_fmt(c.get('tpot_ratio'), '.3f')} | {_fmt(a.get('itl_median_ms'), '.3f')} | "
                     f"{_fmt(b.get('itl_median_ms'), '.3f')} | {_fmt(c.get('itl_median_ratio'), '.3f')} | "
                     f"{_fmt(a.get('server_itl_ms'), '.3f')} | {_fmt(b.get('server_itl_ms'), '.3f')} | "
                     f"{_fmt(c.get('server_itl_ratio'), '.3f')} | {_fmt(a.get('decode_tok_s'), '.0f')} | "
                     f"{_fmt(b.get('decode_tok_s'), '.0f')} | {_fmt(c.get('tok_s_ratio'), '.3f')} |")
    mixed = cells.get("mixed")
    if mixed and mixed.get("total_tok_s_ratio") is not None:
        lines += ["", f"mixed: total throughput (decode + prefill prompt tokens) A "
                      f"{_fmt(mixed['A']['total_tok_s'], '.0f')} tok/s, B {_fmt(mixed['B']['total_tok_s'], '.0f')} "
                      f"tok/s, ratio {mixed['total_tok_s_ratio']:.3f}"]
    if result.get("reanalyzed"):
        lines += ["", f"Reanalyzed from the raw runs of {result['reanalyzed']} with today's definitions."]
    if result.get("skipped"):
        lines += ["", f"not run (budget): {', '.join(result['skipped'])}"]
    if result.get("error"):
        lines += ["", f"stopped: {result['error']}"]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], png: Path) -> None:
    """Each cell's judged ratio with its interval as an error bar, TPOT's ratio beside it, the target
    line at 0.98, to ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result.get("cells", {})
    names = list(cells)
    judged = [cells[n].get("judged_ratio") or cells[n].get("tpot_ratio") or 0.0 for n in names]
    intervals = [cells[n].get("judged_interval") for n in names]
    tpot = [cells[n].get("tpot_ratio") or 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names) + 2), 4.5))
    xs = list(range(len(names)))
    err = [[max(0.0, j - iv[0]) if iv else 0.0 for j, iv in zip(judged, intervals, strict=True)],
           [max(0.0, iv[1] - j) if iv else 0.0 for j, iv in zip(judged, intervals, strict=True)]]
    ax.bar([x - 0.2 for x in xs], judged, width=0.4, yerr=err, capsize=3,
           label=f"judged ratio, {CONFIDENCE:.0%} interval")
    ax.bar([x + 0.2 for x in xs], tpot, width=0.4, alpha=0.5, label="TPOT ratio (client)")
    twins = [(x, cells[n]["twin_ratio"], cells[n].get("twin_interval")) for x, n in zip(xs, names, strict=True)
             if cells[n].get("twin_ratio")]
    if twins:
        ax.errorbar([x - 0.2 for x, _, _ in twins], [t for _, t, _ in twins],
                    yerr=[[max(0.0, t - iv[0]) if iv else 0.0 for _, t, iv in twins],
                          [max(0.0, iv[1] - t) if iv else 0.0 for _, t, iv in twins]],
                    fmt="D", color="grey", capsize=3, label="twin C / A (null), interval")
    ax.axhline(TARGET, color="red", linestyle="--", linewidth=1, label=f"target {TARGET}")
    ax.axhline(1.0, color="black", linewidth=0.6)
    labels = [f"{n}\n{(cells[n].get('verdict') or '')}" for n in names]
    ax.set_xticks(xs, labels, rotation=30, ha="right", fontsize=8)
    vals = [v for v in judged + tpot if v] + [iv[k] for iv in intervals if iv for k in (0, 1)]
    vals += [iv[k] for n in names if (iv := cells[n].get("twin_interval")) for k in (0, 1)]
    ax.set_ylim(min([*vals, TARGET]) - 0.03, max([*vals, 1.0]) + 0.03)
    s = result.get("settings", {})
    faster = "A (the series) faster" if s.get("b_tree") else "project-before-merge faster"
    ax.set(ylabel=f"ratio (> 1: {faster})", xlabel="cell (batch x context), verdict")
    what = comparison(s, short=True)
    ax.set_title(f"{what}: TP{s.get('tp')} x DCP{s.get('dcp')} "
                 f"{s.get('transport')}{' (partial)' if result.get('partial') else ''}", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def load_result(path: Path) -> dict[str, Any]:
    """An ``engine.json``, gzipped or not (the docs keep large ones as ``engine.json.gz``)."""
    import gzip

    raw = path.read_bytes()
    result = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    if not isinstance(result, dict) or "cells" not in result:
        raise ValueError("no 'cells' in it")
    return result


def reanalyze(result: dict[str, Any], source: str) -> dict[str, Any]:
    """``result`` (an ``engine.json``) with every run's summary recomputed from its raw chunk arrivals
    (the server ITL kept as that run read it) and every cell judged again: today's definitions on an
    earlier run's measurements."""
    out = dict(result)
    runs = []
    for run in result.get("runs", []):
        reqs = [Request(q["sent"], list(q["arrivals"]), list(q["tokens"]), prompt_tokens=q.get("prompt_tokens", 0),
                        kind=q.get("kind", "decode"), cached_tokens=q.get("cached_tokens"))
                for q in run.get("requests", [])]
        summary = summarize(reqs)
        summary["server_itl_ms"] = run.get("summary", {}).get("server_itl_ms")
        runs.append(run | {"summary": summary})
    st = result.get("settings", {})
    cells = {}
    for name, old in result.get("cells", {}).items():
        mine = [r for r in runs if r["cell"] == name]
        cells[name] = cell_summary(mine, expect_cached=bool(st.get("prefix_caching", True)), mixed=name == "mixed",
                                   name=name) | {"seconds": old.get("seconds")}
    out |= {"runs": runs, "cells": cells, "reanalyzed": source, "definitions": DEFINITIONS}
    return out


def write_outputs(result: dict[str, Any], out: Path, *, draw: bool = True, json_too: bool = True) -> None:
    if json_too:
        write_file(out / "engine.json", json.dumps(result, indent=1) + "\n")
    write_file(out / "engine.md", table(result))
    if not draw:
        return
    try:
        plot(result, out / "engine.png")
    except ImportError:
        progress("matplotlib missing here: draw the plot later with --plot engine.json")


def versions() -> dict[str, Any]:
    """vLLM, torch, Python, host and GPUs, as far as this machine tells without importing vLLM."""
    from importlib import metadata

    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    for dist in ("vllm", "torch", "httpx"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
        info["gpus"] = [ln.strip() for ln in smi.stdout.splitlines() if ln.strip()]
    except (OSError, subprocess.TimeoutExpired):
        info["gpus"] = []
    return info


# ------------------------------------------------------------------------------------------------- run


def _model_config(model: Path, generate: bool) -> dict[str, Any]:
    cfg = model / "config.json"
    if not cfg.exists() and generate:
        from overlay.engine.checkpoint import TinyGlm5Spec
        from overlay.engine.checkpoint import generate as gen

        progress(f"generating the checkpoint into {model}")
        gen(model, TinyGlm5Spec(), 0)
    try:
        return json.loads(cfg.read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"{cfg}: cannot read the checkpoint's config ({exc})") from None


def run_cell(cell: Cell, servers: dict[str, Server], st: Settings, timeout_s: float) -> list[dict[str, Any]]:
    """Warm-ups then the measured rounds of one cell (``round_order``); every run's record."""
    prompts = cell_prompts(cell, st.seed)
    records: list[dict[str, Any]] = []
    sides = [side for side in st.sides() if side in servers]
    count = {side: 0 for side in sides}

    def one(side: str, warmup: bool) -> None:
        server = servers[side]
        if (dead := _death(server)) is not None:
            raise BenchError(dead)
        idx = count[side]
        mixed = None
        if cell.mixed:
            mixed = (cell.context, st.mixed_interval, st.seed, f"{'warm' if warmup else idx}")
        t = time.monotonic()
        before = scrape_itl(server)
        reqs = run_once(server, cell, prompts, st.decode_tokens, timeout_s, mixed)
        summary = summarize(reqs)
        summary["server_itl_ms"] = itl_ms_between(before, scrape_itl(server))
        if not warmup:
            count[side] += 1
        records.append({"cell": cell.name, "server": side, "warmup": warmup, "seq": len(records),
                        "repeat": None if warmup else idx, "summary": summary,
                        "requests": [r.to_dict() for r in reqs], "seconds": time.monotonic() - t})
        measured[side] += 0.0 if warmup else records[-1]["seconds"]
        progress(f"{cell.name} {'warm-up' if warmup else f'run {idx + 1}'} {side}: "
                 f"TPOT {_fmt(summary.get('tpot_ms'), '.3f')} ms, median ITL "
                 f"{_fmt(summary.get('itl_median_ms'), '.3f')} ms, {_fmt(summary.get('decode_tok_s'), '.0f')} tok/s, "
                 f"server ITL {_fmt(summary.get('server_itl_ms'), '.3f')} ms"
                 + (f", {summary.get('prefills_in_window')} prefills in window" if cell.mixed else ""))

    measured = {side: 0.0 for side in sides}
    for side in sides:  # one request first: the shared prefix is computed once, then cached
        run_once(servers[side], cell, prompts[:1], 1, timeout_s)
        one(side, warmup=True)
    for k in range(max(st.repeats, st.max_repeats)):
        if k >= st.repeats and min(measured.values()) >= st.cell_seconds:
            break
        for side in round_order(k, len(sides)):
            one(side, warmup=False)
    return records


def run(ns: argparse.Namespace) -> int:
    out: Path = ns.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    try:
        cells = parse_cells(ns.cells, ns.batches, ns.contexts, mixed_batch=ns.mixed_batch,
                            mixed_context=ns.mixed_context, mixed=not ns.no_mixed)
    except ValueError as exc:
        print(f"bench-engine: {exc}", file=sys.stderr)
        return 2
    model = Path(os.path.expanduser(ns.model)) if ns.model else None
    if model is None:
        from overlay.engine.checkpoint import TinyGlm5Spec, checkpoint_id, default_cache

        model = default_cache() / checkpoint_id(TinyGlm5Spec(), 0)
    try:
        config = _model_config(model, generate=not ns.model or ns.server_cmd is None)
    except BenchError as exc:
        print(f"bench-engine: {exc}", file=sys.stderr)
        return 2
    layers = int(config.get("num_hidden_layers") or 0)  # the MTP layer is not loaded without spec decode
    biggest = max(c.context for c in cells) + ns.decode_tokens + MODEL_LEN_MARGIN
    st = Settings(
        model=str(model), tp=ns.tp, dcp=ns.dcp, transport=ns.transport,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        max_model_len=ns.max_model_len or biggest,
        max_position_embeddings=config.get("max_position_embeddings"),
        max_num_seqs=ns.max_num_seqs or max(max(c.batch for c in cells), ns.mixed_batch + 16),
        max_num_batched_tokens=ns.max_num_batched_tokens, prefix_caching=not ns.no_prefix_caching,
        max_cudagraph_capture_size=ns.max_cudagraph_capture_size, decode_tokens=ns.decode_tokens,
        repeats=ns.repeats, cell_seconds=ns.cell_seconds, max_repeats=ns.max_repeats, null=ns.null,
        twin=not ns.no_twin, seed=ns.seed, mixed_batch=ns.mixed_batch, mixed_context=ns.mixed_context,
        mixed_interval=ns.mixed_interval, layers=layers, deep_gemm_standin=not ns.no_deep_gemm_standin,
        extra_args=shlex.split(ns.server_args or ""),
        b_tree=str(ns.b_tree.resolve()) if ns.b_tree else "", b_label=ns.b_label or "")
    st.kv_cache_memory_bytes = ns.kv_cache_memory_bytes or kv_cache_bytes(
        -(-largest_tokens(cells, ns.decode_tokens) // ns.dcp), max(layers, 1))
    result: dict[str, Any] = {
        "format": 1, "partial": True, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": asdict(st), "cells_planned": [c.name for c in cells], "versions": versions(),
        "definitions": DEFINITIONS,
        "cells": {}, "runs": [], "skipped": [], "target": TARGET,
    }
    gpus = result["versions"].get("gpus") or []
    result["gpu"] = f"{len(gpus)}x {gpus[0].split(',')[0]}" if gpus else ""
    ports = dict(zip(FLAGS, [*ns.ports, max(ns.ports) + 1][:3], strict=True))
    servers: dict[str, Server] = {}
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout`, a job scheduler: write what was measured, stop all
    rc = 0
    try:
        for side in st.sides():
            cmd = command(ns.server_cmd, ns.vllm, st, ports[side], side)
            result.setdefault("commands", {})[side] = shlex.join(cmd)
            servers[side] = launch(side, cmd, st.env(side, out), out / f"server-{side}.log", ports[side])
        progress(f"started servers {', '.join(f'{k} (pid {v.proc.pid})' for k, v in servers.items())}; logs "
                 f"{out}/server-<A|B|C>.log; KV cache {st.kv_cache_memory_bytes / 2**30:.2f} GiB, "
                 f"max-model-len {st.max_model_len}, {len(cells)} cell(s)")
        wait_ready(list(servers.values()), ns.ready_timeout)
        result["ready_s"] = time.monotonic() - t_start
        durations: list[float] = []
        for i, cell in enumerate(cells):
            elapsed = time.monotonic() - t_start
            estimate = max(durations) * 1.5 + 10.0 if durations else 0.0
            if ns.budget and elapsed + estimate > ns.budget:
                result["skipped"] = [c.name for c in cells[i:]]
                progress(f"budget: {ns.budget - elapsed:.0f} s left, a cell takes ~{estimate:.0f} s: "
                         f"not starting {', '.join(result['skipped'])}")
                break
            progress(f"cell {cell.name} ({i + 1}/{len(cells)})")
            t = time.monotonic()
            records = run_cell(cell, servers, st, ns.request_timeout)
            durations.append(time.monotonic() - t)
            result["runs"] += records
            summary = cell_summary(records, expect_cached=st.prefix_caching, mixed=cell.mixed, name=cell.name)
            summary["seconds"] = durations[-1]
            result["cells"][cell.name] = summary
            progress(f"{cell.name}: TPOT A {_fmt(summary['A']['tpot_ms'], '.3f')} ms, B "
                     f"{_fmt(summary['B']['tpot_ms'], '.3f')} ms, ratio {_fmt(summary['tpot_ratio'], '.3f')}; "
                     f"tok/s ratio {_fmt(summary['tok_s_ratio'], '.3f')}; server ITL ratio "
                     f"{_fmt(summary['server_itl_ratio'], '.3f')}; judged {summary['judged']} "
                     f"{_fmt(summary['judged_ratio'], '.3f')}, twin {_fmt(summary.get('twin_ratio'), '.3f')}: "
                     f"{summary['verdict']}"
                     + (f"  FLAG: {'; '.join(summary['flags'])}" if summary["flags"] else ""))
            write_outputs(result, out, draw=False)
        result["partial"] = bool(result["skipped"])
    except BenchError as exc:
        result["error"] = str(exc)
        print(f"bench-engine: {exc}", file=sys.stderr, flush=True)
        rc = 1
    except KeyboardInterrupt:
        result["error"] = "interrupted"
        print("bench-engine: interrupted; writing what was measured", file=sys.stderr, flush=True)
        rc = 130
    finally:
        stop_all(list(servers.values()))
    result["seconds"] = time.monotonic() - t_start
    write_outputs(result, out)
    print(table(result), flush=True)
    flagged = [n for n, c in result["cells"].items() if c["flags"]]
    progress(f"wrote {out}/engine.json, engine.md, engine.png; {len(result['cells'])} cell(s)"
             + (f", flagged: {', '.join(flagged)}" if flagged else ", none below target")
             + (" (partial)" if result["partial"] else ""))
    return rc


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _ports(text: str) -> tuple[int, ...]:
    values = _ints(text)
    if len(values) not in (2, 3) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError("want two or three different ports, A,B[,C] (C: the twin; default B + 1)")
    return tuple(values)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m overlay.bench.engine", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-engine"))
    ap.add_argument("--plot", type=Path, help="only redraw engine.md and engine.png from this engine.json (or .gz)")
    ap.add_argument("--reanalyze", type=Path,
                    help="recompute every run and cell of this engine.json (or .gz) from its raw chunk arrivals "
                         "with today's definitions; engine.json, .md and .png into --out")
    ap.add_argument("--model", help="checkpoint folder (default: the generated tiny GLM-5, made when missing)")
    ap.add_argument("--batches", type=_ints, default=[1, 8, 64], help="comma-separated (1,8,64)")
    ap.add_argument("--contexts", type=_ints, default=[4096, 16384, 65536], help="comma-separated prompt tokens")
    ap.add_argument("--cells", help="a subset instead, e.g. 1x4096,8x16384,mixed")
    ap.add_argument("--no-mixed", action="store_true", help="without --cells: leave the mixed cell out")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="measured runs per server and cell (ABBA), at least")
    ap.add_argument("--cell-seconds", type=float, default=10.0,
                    help="more ABBA pairs until each server's measured runs of the cell took this long (10)")
    ap.add_argument("--max-repeats", type=int, default=30, help="runs per server and cell, at most (30)")
    ap.add_argument("--null", action="store_true",
                    help="A/A: both servers VLLM_DCP_PROJECT_BEFORE_MERGE=1; the ratios are then the method's "
                         "noise (run it where the A/B is to be read)")
    ap.add_argument("--no-twin", action="store_true",
                    help="two servers only: no twin C of A (flag on too), so no null of the same run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mixed-batch", type=int, default=32)
    ap.add_argument("--mixed-context", type=int, default=4096)
    ap.add_argument("--mixed-interval", type=float, default=0.2, help="seconds between arriving prefills")
    ap.add_argument("--transport", choices=TRANSPORTS, default="direct")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=0, help="per GPU (default: sized from the cells)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--max-model-len", type=int, default=0, help="default: largest context + decode + 64")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="default: max(largest batch, mixed batch + 16)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
    ap.add_argument("--max-cudagraph-capture-size", type=int, default=64)
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="if the engine refuses prefix caching: every run then prefills its whole prompts")
    ap.add_argument("--no-deep-gemm-standin", action="store_true",
                    help="do not put tests/engine/standin (plain-torch DSA indexer logits) on PYTHONPATH")
    ap.add_argument("--server-args", help="more vllm serve arguments, for both servers")
    ap.add_argument("--b-tree", type=Path,
                    help="B runs this vLLM tree (first on its PYTHONPATH; e.g. engine.variants' mtp-as-prefills laid "
                         "out by engine.check's lay_variant) instead of VLLM_DCP_PROJECT_BEFORE_MERGE=0; the flag is 1 "
                         "on every server")
    ap.add_argument("--b-label", help="how reports name B's tree (default: its path)")
    ap.add_argument("--vllm", default=os.environ.get("OVERLAY_VLLM", DEFAULT_VLLM),
                    help=f"the vLLM command line ({DEFAULT_VLLM!r}; env OVERLAY_VLLM)")
    ap.add_argument("--server-cmd", help="a whole server command instead of vllm serve (tests): "
                                         "{port} {model} {name} {side} {args} are filled in")
    ap.add_argument("--ports", type=_ports, default=(8100, 8101, 8102),
                    help="HTTP ports of A,B[,C] (8100,8101,8102)")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--budget", type=float, default=0.0, help="seconds: start no cell that would end later")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    if ns.plot is not None or ns.reanalyze is not None:
        source: Path = ns.plot if ns.plot is not None else ns.reanalyze
        try:
            result = load_result(source)
        except (OSError, ValueError) as exc:
            print(f"bench-engine: {source}: cannot read an engine.json ({exc})", file=sys.stderr)
            return 2
        if ns.reanalyze is not None:
            result = reanalyze(result, source.name)
        ns.out.mkdir(parents=True, exist_ok=True)
        write_outputs(result, ns.out, json_too=source.resolve() != (ns.out / "engine.json").resolve())
        print(table(result), flush=True)
        return 0
    if ns.b_tree is not None and not (ns.b_tree / "vllm").is_dir():
        print(f"bench-engine: --b-tree {ns.b_tree}: not a vLLM tree (no vllm/ folder in it)", file=sys.stderr)
        return 2
    if ns.b_tree is not None and ns.null:
        print("bench-engine: --b-tree and --null exclude each other (a null run compares A with itself)",
              file=sys.stderr)
        return 2
    if ns.repeats < 1 or ns.max_repeats < 1 or ns.decode_tokens < 2 or ns.cell_seconds < 0:
        print("bench-engine: --repeats and --max-repeats must be >= 1, --decode-tokens >= 2, --cell-seconds >= 0",
              file=sys.stderr)
        return 2
    return run(ns)


if __name__ == "__main__":
    raise SystemExit(main())
