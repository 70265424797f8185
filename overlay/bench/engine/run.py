"""bench-engine's run: cells on the servers, round by round, and the command line."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from overlay.bench.engine.cells import Cell, cell_prompts, parse_cells, round_order
from overlay.bench.engine.common import (
    DEFAULT_VLLM,
    DEFINITIONS,
    FLAGS,
    MODEL_LEN_MARGIN,
    TARGET,
    TRANSPORTS,
    BenchError,
    _fmt,
    progress,
)
from overlay.bench.engine.report import load_result, reanalyze, table, versions, write_outputs
from overlay.bench.engine.servers import (
    Settings,
    _death,
    command,
    kv_cache_bytes,
    largest_tokens,
    launch,
    stop_all,
    wait_ready,
)
from overlay.bench.engine.stats import cell_summary, summarize
from overlay.bench.engine.stream import itl_ms_between, run_once, scrape_itl
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
    package_doc = sys.modules["overlay.bench.engine"].__doc__ or ""
    ap = argparse.ArgumentParser(prog="python -m overlay.bench.engine", description=package_doc.splitlines()[0])
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

