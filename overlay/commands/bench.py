"""Benchmarks that print numbers: ``bench-build`` (CPU), ``bench-merge`` and ``bench-engine`` (GPUs)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from overlay.commands.common import add_vllm, at_least, fraction, int_list, non_negative, positive, root


def configure_parser(sub: argparse._SubParsersAction) -> None:
    text = "time a rebuild from the cached wheel against a plain copy of it, and edit -> installed"
    sp = sub.add_parser("bench-build", help=text, description=text)
    add_vllm(sp)
    sp.add_argument("--repeat", type=at_least(1), default=5)
    sp.add_argument("--json-out")
    sp.set_defaults(handler=cmd_bench_build)

    text = ("GPUs: DCP merge + W_UV projection, merge-then-project vs project-then-merge, "
            "per transport (table, JSON, PNG)")
    sp = sub.add_parser("bench-merge", help=text, description=text)
    add_vllm(sp)
    sp.add_argument("--out", default="bench-merge", help="folder for merge.json/.txt/.png")
    sp.add_argument("--tokens", type=at_least(1), nargs="+",
                    help="token counts (default: the sweep's 1, 2, 4, ... past the release's DCP workspace size; "
                         "project_combine's bench: 1 16 128 768 8192)")
    sp.add_argument("--replays", type=at_least(50), default=50, help="timed CUDA-graph replays (>= 50)")
    sp.add_argument("--plot", help="only draw the table and plot from this merge.json")
    sp.add_argument("--ranks", type=at_least(2), default=2,
                    help="DCP ranks, one GPU each, 8 heads per rank (2; 4 and 8 need as many GPUs)")
    sp.add_argument("--tp", type=at_least(1), choices=[1, 2, 4, 8, 16, 32, 64], default=8,
                    help="the sweep: GLM-5's 64 heads over this TP, heads per rank (8: production's TP8)")
    sp.add_argument("--max-num-seqs", type=at_least(1),
                    help="the sweep: max_num_seqs of the config the DCP workspace is sized by (default: the release's)")
    sp.add_argument("--parallel-config", type=_field_value, action="append", default=[], metavar="FIELD=VALUE",
                    help="the sweep: a field of the release's ParallelConfig the managers are built under "
                         "(repeatable; e.g. the projection's switch)")
    sp.add_argument("--bounds", choices=["decode", "none"], default="decode",
                    help="sequence bounds handed to the merge: decode (as the engine passes them: one "
                         "row per sequence, local KV lengths) or none (nothing to mask)")
    sp.add_argument("--profile-eager", type=at_least(1), nargs="*", default=[], metavar="T",
                    help="also profile 20 eager calls of each order at these token counts "
                         "(torch.profiler tables in OUT/profile/, host us per call in merge.json)")
    sp.set_defaults(handler=cmd_bench_merge)

    _configure_bench_engine(sub)


def cmd_bench_build(ns: argparse.Namespace) -> int:
    from overlay.bench.build import run

    return run(root(ns), ns.vllm, repeat=ns.repeat, json_out=Path(ns.json_out) if ns.json_out else None)


def cmd_bench_merge(ns: argparse.Namespace) -> int:
    from overlay.bench.merge import run

    return run(Path(ns.out), tokens=ns.tokens, replays=ns.replays,
               plot_from=Path(ns.plot) if ns.plot else None, ranks=ns.ranks, bounds=ns.bounds,
               profile_tokens=tuple(ns.profile_eager), release=ns.vllm, tp=ns.tp, max_num_seqs=ns.max_num_seqs,
               parallel=tuple(ns.parallel_config))


def _field_value(text: str) -> tuple[str, str]:
    name, eq, value = text.partition("=")
    if not eq or not name.isidentifier() or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: want FIELD=VALUE, e.g. dcp_comm_backend=a2a")
    return name, value


def _ports(text: str) -> tuple[int, ...]:
    values = int_list(1, 65535)(text)
    if len(values) not in (2, 3) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError("want two or three different ports, A,B[,C] (C: the twin; default B + 1)")
    return tuple(values)


def _context(text: str) -> int:
    """A prompt length longer than the part that differs between a cell's requests."""
    from overlay.bench.engine.common import TAIL_TOKENS  # on use: the package imports httpx

    return int(at_least(TAIL_TOKENS + 1)(text))


def _contexts(text: str) -> list[int]:
    from overlay.bench.engine.common import TAIL_TOKENS

    return int_list(TAIL_TOKENS + 1)(text)


def _cells(text: str) -> str:
    """``--cells``: checked now (syntax, at least one cell, none twice); ``parse_cells`` sizes them later."""
    from overlay.bench.engine.cells import parse_cells
    from overlay.bench.engine.common import TAIL_TOKENS

    try:
        parse_cells(text, [], [], mixed_batch=1, mixed_context=TAIL_TOKENS + 1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _configure_bench_engine(sub: argparse._SubParsersAction) -> None:
    from overlay.engine.env import DEFAULT_VLLM, TRANSPORTS  # standard library only: the device needs no venv

    text = ("GPUs: vllm serve of the tiny GLM-5 (TP2 x DCP2), projection before the DCP merge on vs off (each "
            "server told its build's way: --dcp-v-up-proj-before-merge or VLLM_DCP_PROJECT_BEFORE_MERGE) plus a "
            "twin of on (the null), judged per cell with an interval and verdict (engine.json, .md, .png)")
    ap = sub.add_parser("bench-engine", help=text, description=text)
    ap.add_argument("--out", type=Path, default=Path("bench-engine"))
    ap.add_argument("--plot", type=Path, help="only redraw engine.md and engine.png from this engine.json (or .gz)")
    ap.add_argument("--reanalyze", type=Path,
                    help="recompute every run and cell of this engine.json (or .gz) from its raw chunk arrivals "
                         "with today's definitions; engine.json, .md and .png into --out")
    ap.add_argument("--model", help="checkpoint folder (default: the generated tiny GLM-5, made when missing)")
    ap.add_argument("--batches", type=int_list(1), default=[1, 8, 64], help="comma-separated (1,8,64)")
    ap.add_argument("--contexts", type=_contexts, default=[4096, 16384, 65536], help="comma-separated prompt tokens")
    ap.add_argument("--cells", type=_cells, help="a subset instead, e.g. 1x4096,8x16384,mixed")
    ap.add_argument("--no-mixed", action="store_true", help="without --cells: leave the mixed cell out")
    ap.add_argument("--decode-tokens", type=at_least(2), default=128)
    ap.add_argument("--repeats", type=at_least(1), default=5, help="measured runs per server and cell (ABBA), at least")
    ap.add_argument("--cell-seconds", type=non_negative(), default=10.0,
                    help="more ABBA pairs until each server's measured runs of the cell took this long (10)")
    ap.add_argument("--max-repeats", type=at_least(1), default=30, help="runs per server and cell, at most (30)")
    ap.add_argument("--null", action="store_true",
                    help="A/A: every server projection on; the ratios are then the method's "
                         "noise (run it where the A/B is to be read)")
    ap.add_argument("--no-twin", action="store_true",
                    help="two servers only: no twin C of A (projection on too), so no null of the same run")
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--mixed-batch", type=at_least(1), default=32)
    ap.add_argument("--mixed-context", type=_context, default=4096)
    ap.add_argument("--mixed-interval", type=non_negative(), default=0.2, help="seconds between arriving prefills")
    ap.add_argument("--transport", choices=TRANSPORTS, default="direct")
    ap.add_argument("--tp", type=at_least(1), default=2)
    ap.add_argument("--dcp", type=at_least(1), default=2)
    ap.add_argument("--kv-cache-memory-bytes", type=at_least(0), default=0,
                    help="per GPU (default: sized from the cells)")
    ap.add_argument("--gpu-memory-utilization", type=fraction(), default=0.3)
    ap.add_argument("--max-model-len", type=at_least(0), default=0, help="default: largest context + decode + 64")
    ap.add_argument("--max-num-seqs", type=at_least(0), default=0, help="default: max(largest batch, mixed batch + 16)")
    ap.add_argument("--max-num-batched-tokens", type=at_least(1), default=None, help="default: vLLM's")
    ap.add_argument("--max-cudagraph-capture-size", type=at_least(1), default=64)
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="if the engine refuses prefix caching: every run then prefills its whole prompts")
    ap.add_argument("--no-deep-gemm-standin", action="store_true",
                    help="do not put tests/engine/standin (plain-torch DSA indexer logits) on PYTHONPATH")
    ap.add_argument("--server-args", help="more vllm serve arguments, for both servers")
    ap.add_argument("--b-tree", type=Path,
                    help="B runs this vLLM tree (first on its PYTHONPATH; e.g. engine-variants' mtp-as-prefills "
                         "laid out by engine-check's lay_variant) instead of projection off; the projection is "
                         "on on every server, spelled for the build each serves")
    ap.add_argument("--b-label", help="how reports name B's tree or site (default: its path)")
    ap.add_argument("--b-site", type=Path,
                    help="B runs another release's staged site (scripts/device-run.sh's OVERLAY_DEVICE_SITE of "
                         "another staging): it and its .pth paths replace the inherited PYTHONPATH on B alone; "
                         "the projection is on on every server, spelled for the build each serves (release A/B "
                         "on one machine)")
    ap.add_argument("--vllm", default=os.environ.get("OVERLAY_VLLM", DEFAULT_VLLM),
                    help=f"the vLLM command line ({DEFAULT_VLLM!r}; env OVERLAY_VLLM)")
    ap.add_argument("--server-cmd", help="a whole server command instead of vllm serve (tests): "
                                         "{port} {model} {name} {side} {args} are filled in ({args}: the "
                                         "server's vLLM arguments, its projection among them where its build "
                                         "takes it as an argument)")
    ap.add_argument("--ports", type=_ports, default=(8100, 8101, 8102),
                    help="HTTP ports of A,B[,C] (8100,8101,8102)")
    ap.add_argument("--ready-timeout", type=positive("seconds"), default=900.0)
    ap.add_argument("--request-timeout", type=positive("seconds"), default=1800.0)
    ap.add_argument("--budget", type=non_negative(), default=0.0,
                    help="seconds: start no cell that would end later (0: no budget)")
    ap.set_defaults(handler=cmd_bench_engine)


def cmd_bench_engine(ns: argparse.Namespace) -> int:
    from dataclasses import fields

    from overlay.bench.engine.run import RunOptions, check_options, redraw, run

    if ns.plot is not None or ns.reanalyze is not None:
        return redraw(ns.plot if ns.plot is not None else ns.reanalyze, ns.out, recompute=ns.reanalyze is not None)
    opts = RunOptions(**{f.name: getattr(ns, f.name) for f in fields(RunOptions)})
    check_options(opts)
    return run(opts)
