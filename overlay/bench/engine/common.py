"""Constants, definitions and the error of bench-engine: what every part of it shares."""

from __future__ import annotations

from overlay.engine.env import DEFAULT_VLLM, TRANSPORTS  # noqa: F401  (declared beside the command line's other engine facts)
from overlay.errors import OverlayError

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
    "twin_ratio": "the judged metric, twin C (identical to A: projection on) against A, ratio of medians "
                  "(> 1: A faster)",
    "twin_interval": "its bootstrap interval over the rounds (run k of A with run k of C)",
    "twins_differ": f"twin_interval leaves out 1 and twin_ratio lies outside [{TARGET}, 1 / {TARGET}]",
}
SERVED_NAME = "tiny-glm5"
# The projection through W_UV before the DCP merge per server, as a value: each server gets the spelling of the
# build it serves (overlay.releases.projection: an engine argument or a variable), bench.engine.servers
SIDES = {"A": "on", "B": "off"}
TWIN = "C"  # a third server, A's twin (projection on too): A against C is the run's own null
FLAGS = {**SIDES, TWIN: "on"}
# The measured runs' order, a round per pair (two servers) or triple (with the twin): with three, the
# six orders in turn, so each server is as often first, second and last, and after each of the others.
ORDERS = {2: (("A", "B"), ("B", "A")),
          3: (("A", "B", "C"), ("B", "C", "A"), ("C", "A", "B"), ("C", "B", "A"), ("B", "A", "C"), ("A", "C", "B"))}


class BenchError(OverlayError):
    """The run cannot go on (a server died, a request failed); the message is one line."""


class BenchUsageError(BenchError):
    """The options or an input file cannot make a run; nothing was started."""

    exit_code = 2



def progress(msg: str) -> None:
    print(f"{PREFIX} {msg}", flush=True)


def fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"
