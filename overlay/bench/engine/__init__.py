"""``make bench-engine``: engine-level A/B of the projection before the DCP merge on real ``vllm serve`` servers.

Two servers of the generated tiny GLM-5 checkpoint (``overlay.engine.checkpoint``) run at once on the
same GPUs, identical but for one setting: A with the projection through ``W_UV`` before the DCP merge on (our
dcp-project-before-merge), B with it off (vLLM's merge-then-project order). Each server is told the way the
build it serves reads it (``overlay.releases.projection``; the switch a release fact read from the build's own
tree, the vLLM this process imports, or B's ``--b-tree`` / ``--b-site``): ``--dcp-v-up-proj-before-merge on|off``
among its arguments where the build has that engine argument (0.34.0's series), else
``VLLM_DCP_PROJECT_BEFORE_MERGE`` 1 / 0 in its environment (0.28.0's); a build with neither is refused in one
line before any server starts (on vs off there would measure nothing). Both serve at
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

The twin (default; ``--no-twin`` leaves it out): a third server C, identical to A (the projection on too),
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
servers can see: hence the twin. ``--null`` runs B with the projection on too (A/A/A): every ratio is then
noise. ``--reanalyze engine.json`` recomputes an earlier run's summaries and cells from its raw
chunk arrivals with these definitions.

Writes ``engine.json`` (settings, versions, every run's raw numbers, per-cell medians and ratios;
rewritten after every cell, ``partial`` until the end), ``engine.md`` (the table) and ``engine.png``
(matplotlib Agg; ``--plot engine.json`` redraws the table and plot of an earlier run, e.g. where the
GPU machine lacks matplotlib); the servers' logs are ``server-A.log`` and ``server-B.log``.
``--budget S`` starts no cell that would not end within S seconds of the start (estimated from the
cells so far) and marks the result partial. A server that dies stops the run with one line naming
it and its log's telling line (exit 1); what was measured is written first.

The package's rooms: ``common`` (constants, definitions, ``BenchError``), ``cells`` (cells and the
rounds' order), ``stream`` (streamed requests, ``/metrics``), ``stats`` (summaries, ratios, intervals,
verdicts), ``servers`` (settings, command, start, readiness), ``report`` (engine.json/md/png,
``--reanalyze``) and ``run`` (the rounds on the servers, ``RunOptions``); the command line is
``overlay.commands.bench``.
"""

from __future__ import annotations

from overlay.bench.engine.cells import Cell, abba, cell_prompts, fresh_prompt, parse_cells, round_order
from overlay.bench.engine.common import (
    DEFAULT_VLLM,
    DEFINITIONS,
    FLAGS,
    METRICS,
    SIDES,
    TARGET,
    TWIN,
    BenchError,
    BenchUsageError,
    progress,
)
from overlay.bench.engine.report import load_result, plot, reanalyze, table, write_outputs
from overlay.bench.engine.run import RunOptions, check_options, redraw, run, run_cell
from overlay.bench.engine.servers import Settings, command, comparison, kv_cache_bytes, largest_tokens
from overlay.bench.engine.stats import (
    Request,
    cell_summary,
    flags,
    ratio_interval,
    steady_intervals,
    summarize,
    twins_differ,
    verdict,
)
from overlay.bench.engine.stream import itl_ms_between, itl_totals, run_once, scrape_itl, stream_request

__all__ = [
    "DEFAULT_VLLM",
    "DEFINITIONS",
    "FLAGS",
    "METRICS",
    "SIDES",
    "TARGET",
    "TWIN",
    "BenchError",
    "BenchUsageError",
    "Cell",
    "Request",
    "RunOptions",
    "Settings",
    "abba",
    "cell_prompts",
    "cell_summary",
    "check_options",
    "command",
    "comparison",
    "flags",
    "fresh_prompt",
    "itl_ms_between",
    "itl_totals",
    "kv_cache_bytes",
    "largest_tokens",
    "load_result",
    "parse_cells",
    "plot",
    "progress",
    "ratio_interval",
    "reanalyze",
    "redraw",
    "round_order",
    "run",
    "run_cell",
    "run_once",
    "scrape_itl",
    "steady_intervals",
    "stream_request",
    "summarize",
    "table",
    "twins_differ",
    "verdict",
    "write_outputs",
]
