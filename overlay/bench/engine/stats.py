"""bench-engine's statistics: per-run summaries, ratios, bootstrap intervals, verdicts, flags."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Any

from overlay.bench.engine.common import (
    BOOTSTRAP_SAMPLES,
    CACHED_MIN,
    CONFIDENCE,
    KEPT_UP_MIN,
    METRIC_RATIO,
    METRICS,
    MIN_PAIRS,
    SIDES,
    TARGET,
    TWIN,
)


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


