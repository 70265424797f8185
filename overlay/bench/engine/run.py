"""bench-engine's run: cells on the servers, round by round, and the command line."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from overlay.bench.engine.cells import Cell, cell_prompts, parse_cells, round_order
from overlay.bench.engine.common import (
    DEFINITIONS,
    FLAGS,
    MODEL_LEN_MARGIN,
    SIDES,
    TARGET,
    TWIN,
    BenchError,
    BenchUsageError,
    fmt,
    progress,
)
from overlay.bench.engine.report import load_result, reanalyze, table, versions, write_outputs
from overlay.bench.engine.servers import (
    Settings,
    command,
    death_of,
    kv_cache_bytes,
    largest_tokens,
    launch,
    projection_plan,
    stop_all,
    wait_ready,
)
from overlay.bench.engine.stats import cell_summary, summarize
from overlay.bench.engine.stream import itl_ms_between, run_once, scrape_itl
from overlay.interrupt import raise_interrupt
from overlay.outpaths import check_dir
from overlay.regress.server import Server


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


def run_cell(cell: Cell, servers: dict[str, Server], st: Settings, timeout_s: float,
             records: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Warm-ups then the measured rounds of one cell (``round_order``); every run's record, appended to
    ``records`` as it is made (so a cell cut short by a dead server keeps what it measured)."""
    prompts = cell_prompts(cell, st.seed)
    records = [] if records is None else records
    sides = [side for side in st.sides() if side in servers]
    count = {side: 0 for side in sides}

    def one(side: str, warmup: bool) -> None:
        server = servers[side]
        if (dead := death_of(server)) is not None:
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
                 f"TPOT {fmt(summary.get('tpot_ms'), '.3f')} ms, median ITL "
                 f"{fmt(summary.get('itl_median_ms'), '.3f')} ms, {fmt(summary.get('decode_tok_s'), '.0f')} tok/s, "
                 f"server ITL {fmt(summary.get('server_itl_ms'), '.3f')} ms"
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


@dataclass
class RunOptions:
    """What a person chose for one run: the command line's options (``overlay bench-engine``), by name."""

    out: Path
    model: str | None
    batches: list[int]
    contexts: list[int]
    cells: str | None
    no_mixed: bool
    decode_tokens: int
    repeats: int
    cell_seconds: float
    max_repeats: int
    null: bool
    no_twin: bool
    seed: int
    mixed_batch: int
    mixed_context: int
    mixed_interval: float
    transport: str
    tp: int
    dcp: int
    kv_cache_memory_bytes: int
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    max_cudagraph_capture_size: int
    no_prefix_caching: bool
    no_deep_gemm_standin: bool
    server_args: str | None
    b_tree: Path | None
    b_label: str | None
    b_site: Path | None
    vllm: str
    server_cmd: str | None
    ports: tuple[int, ...]
    ready_timeout: float
    request_timeout: float
    budget: float


def run(opts: RunOptions) -> int:
    """One whole run: cells parsed, servers started, cells measured round by round, results written."""
    out: Path = check_dir(opts.out, "--out")
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    cells, st = plan(opts)
    result = _new_result(st, cells)
    servers: dict[str, Server] = {}
    signal.signal(signal.SIGTERM, raise_interrupt)  # `timeout`, a job scheduler: write what was measured, stop all
    rc = 0
    try:
        _start_servers(opts, st, out, servers, result)
        progress(f"started servers {', '.join(f'{k} (pid {v.proc.pid})' for k, v in servers.items())}; logs "
                 f"{out}/server-<A|B|C>.log; KV cache {st.kv_cache_memory_bytes / 2**30:.2f} GiB, "
                 f"max-model-len {st.max_model_len}, {len(cells)} cell(s)")
        wait_ready(list(servers.values()), opts.ready_timeout)
        result["ready_s"] = time.monotonic() - t_start
        _measure(cells, servers, st, opts, result, out, t_start)
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


def plan(opts: RunOptions) -> tuple[list[Cell], Settings]:
    """The cells and the servers' settings of a run, checked against the model before any server starts."""
    try:
        cells = parse_cells(opts.cells, opts.batches, opts.contexts, mixed_batch=opts.mixed_batch,
                            mixed_context=opts.mixed_context, mixed=not opts.no_mixed)
    except ValueError as exc:
        raise BenchUsageError(str(exc)) from None
    # how each server's build takes the projection, before a checkpoint is made or a server started: a build
    # that cannot take its server's value is refused here
    b_given = opts.b_tree or opts.b_site
    b_folder = str(b_given.resolve()) if b_given and not opts.null else ""
    sides = [*SIDES, *([] if opts.no_twin else [TWIN])]
    switches, builds = projection_plan(sides, opts.null or bool(b_given), b_folder)
    model = Path(os.path.expanduser(opts.model)) if opts.model else None
    if model is None:
        from overlay.engine.checkpoint import TinyGlm5Spec, checkpoint_id, default_cache

        model = default_cache() / checkpoint_id(TinyGlm5Spec(), 0)
    try:
        config = _model_config(model, generate=not opts.model or opts.server_cmd is None)
    except BenchError as exc:
        raise BenchUsageError(str(exc)) from None
    layers = int(config.get("num_hidden_layers") or 0)  # the MTP layer is not loaded without spec decode
    biggest = max(c.context for c in cells) + opts.decode_tokens + MODEL_LEN_MARGIN
    limit = config.get("max_position_embeddings")
    too_long = [c.name for c in cells if isinstance(limit, int) and c.context > limit]
    if too_long:  # decode and margin past it are covered by --hf-overrides (Settings.args); a prompt is not
        raise BenchUsageError(f"{model}: the model holds prompts of {limit} tokens (max_position_embeddings); "
                              f"cell(s) {', '.join(too_long)} want more: choose shorter --cells/--contexts")
    st = Settings(
        model=str(model), tp=opts.tp, dcp=opts.dcp, transport=opts.transport,
        gpu_memory_utilization=opts.gpu_memory_utilization,
        max_model_len=opts.max_model_len or biggest,
        max_position_embeddings=config.get("max_position_embeddings"),
        max_num_seqs=opts.max_num_seqs or max(max(c.batch for c in cells), opts.mixed_batch + 16),
        max_num_batched_tokens=opts.max_num_batched_tokens, prefix_caching=not opts.no_prefix_caching,
        max_cudagraph_capture_size=opts.max_cudagraph_capture_size, decode_tokens=opts.decode_tokens,
        repeats=opts.repeats, cell_seconds=opts.cell_seconds, max_repeats=opts.max_repeats, null=opts.null,
        twin=not opts.no_twin, seed=opts.seed, mixed_batch=opts.mixed_batch, mixed_context=opts.mixed_context,
        mixed_interval=opts.mixed_interval, layers=layers, deep_gemm_standin=not opts.no_deep_gemm_standin,
        extra_args=shlex.split(opts.server_args or ""),
        b_tree=str(opts.b_tree.resolve()) if opts.b_tree else "", b_label=opts.b_label or "",
        b_site=str(opts.b_site.resolve()) if opts.b_site else "", switches=switches, builds=builds)
    st.kv_cache_memory_bytes = opts.kv_cache_memory_bytes or kv_cache_bytes(
        -(-largest_tokens(cells, opts.decode_tokens) // opts.dcp), max(layers, 1))
    return cells, st


def _new_result(st: Settings, cells: list[Cell]) -> dict[str, Any]:
    """``engine.json`` as it starts: the settings and plan, no cell measured yet."""
    result: dict[str, Any] = {
        "format": 1, "partial": True, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": asdict(st), "cells_planned": [c.name for c in cells], "versions": versions(),
        "definitions": DEFINITIONS,
        "cells": {}, "runs": [], "skipped": [], "target": TARGET,
    }
    gpus = result["versions"].get("gpus") or []
    result["gpu"] = f"{len(gpus)}x {gpus[0].split(',')[0]}" if gpus else ""
    return result


def _start_servers(opts: RunOptions, st: Settings, out: Path, servers: dict[str, Server],
                   result: dict[str, Any]) -> None:
    """Launch one server per side into ``servers`` (filled as they start, so that all are stopped after
    a failure), their commands into ``result``."""
    ports = dict(zip(FLAGS, [*opts.ports, max(opts.ports) + 1][:3], strict=True))
    for side in st.sides():
        args, env = st.spelling(side)
        told = shlex.join(args) or " ".join(f"{k}={v}" for k, v in env.items())
        progress(f"server {side}: projection {st.projection(side)} ({told}; {st.builds[side]})")
        cmd = command(opts.server_cmd, opts.vllm, st, ports[side], side)
        result.setdefault("commands", {})[side] = shlex.join(cmd)
        servers[side] = launch(side, cmd, st.env(side, out), out / f"server-{side}.log", ports[side],
                               st.projection(side))


def _measure(cells: list[Cell], servers: dict[str, Server], st: Settings, opts: RunOptions,
             result: dict[str, Any], out: Path, t_start: float) -> None:
    """Every cell in turn, within the budget; ``engine.json`` rewritten after each."""
    durations: list[float] = []
    for i, cell in enumerate(cells):
        elapsed = time.monotonic() - t_start
        estimate = max(durations) * 1.5 + 10.0 if durations else 0.0
        if opts.budget and elapsed + estimate > opts.budget:
            result["skipped"] = [c.name for c in cells[i:]]
            progress(f"budget: {opts.budget - elapsed:.0f} s left, a cell takes ~{estimate:.0f} s: "
                     f"not starting {', '.join(result['skipped'])}")
            break
        progress(f"cell {cell.name} ({i + 1}/{len(cells)})")
        t = time.monotonic()
        records: list[dict[str, Any]] = []
        try:
            run_cell(cell, servers, st, opts.request_timeout, records)
        finally:  # a server dying mid-cell: the runs measured before stay in engine.json
            result["runs"] += records
        durations.append(time.monotonic() - t)
        summary = cell_summary(records, expect_cached=st.prefix_caching, mixed=cell.mixed, name=cell.name)
        summary["seconds"] = durations[-1]
        result["cells"][cell.name] = summary
        progress(_cell_line(cell.name, summary))
        write_outputs(result, out, draw=False)


def _cell_line(name: str, summary: dict[str, Any]) -> str:
    """A measured cell in one progress line."""
    return (f"{name}: TPOT A {fmt(summary['A']['tpot_ms'], '.3f')} ms, B "
            f"{fmt(summary['B']['tpot_ms'], '.3f')} ms, ratio {fmt(summary['tpot_ratio'], '.3f')}; "
            f"tok/s ratio {fmt(summary['tok_s_ratio'], '.3f')}; server ITL ratio "
            f"{fmt(summary['server_itl_ratio'], '.3f')}; judged {summary['judged']} "
            f"{fmt(summary['judged_ratio'], '.3f')}, twin {fmt(summary.get('twin_ratio'), '.3f')}: "
            f"{summary['verdict']}"
            + (f"  FLAG: {'; '.join(summary['flags'])}" if summary["flags"] else ""))


def redraw(source: Path, out: Path, *, recompute: bool) -> int:
    """``--plot`` / ``--reanalyze``: an earlier ``engine.json`` (or ``.gz``) drawn again, or recomputed first."""
    try:
        result = load_result(source)
    except (OSError, ValueError, EOFError) as exc:
        raise BenchUsageError(f"{source}: cannot read an engine.json ({exc})") from None
    check_dir(out, "--out")
    if recompute:
        result = reanalyze(result, source.name)
    out.mkdir(parents=True, exist_ok=True)
    write_outputs(result, out, json_too=source.resolve() != (out / "engine.json").resolve())
    print(table(result), flush=True)
    return 0


def check_options(opts: RunOptions) -> None:
    """Refuse choices that cannot make a run before any server starts."""
    if opts.b_tree is not None and not (opts.b_tree / "vllm").is_dir():
        raise BenchUsageError(f"--b-tree {opts.b_tree}: not a vLLM tree (no vllm/ folder in it)")
    if opts.b_tree is not None and opts.null:
        raise BenchUsageError("--b-tree and --null exclude each other (a null run compares A with itself)")
    if opts.b_site is not None and not (opts.b_site / "vllm").is_dir():
        raise BenchUsageError(f"--b-site {opts.b_site}: not a staged site (no vllm/ folder in it)")
    if opts.b_site is not None and opts.null:
        raise BenchUsageError("--b-site and --null exclude each other (a null run compares A with itself)")
