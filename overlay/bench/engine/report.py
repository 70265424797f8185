"""bench-engine's outputs: engine.json, engine.md (tables), engine.png, and --reanalyze."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any

from overlay import jsonfile
from overlay.atomic import write_file
from overlay.bench.engine.common import CONFIDENCE, DEFINITIONS, FLAGS, METRIC_RATIO, METRICS, TARGET, fmt, progress
from overlay.bench.engine.servers import comparison
from overlay.bench.engine.stats import Request, cell_summary, summarize
from overlay.errors import OverlayError


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
             f"{_runs_text(s)}, medians; {result.get('gpu') or ''}"
             + (f"; both servers: `{' '.join(s['extra_args'])}`" if s.get("extra_args") else ""),
             "",
             f"Ratios are > 1 when {'the series' if s.get('b_tree') or s.get('b_site') else 'the optimization'} (A) "
             "is faster: "
             "B / A for times, A / B for tok/s. Each cell is "
             "judged on one metric: decode cells on the median ITL (the median gap between single-token "
             "chunks: one decode step; the prefill of the requests' last tokens and other stalls left out) "
             "when the client kept up, else on vLLM's own mean inter-token latency (server ITL, ``/metrics`` "
             "before and after each run), else TPOT; the mixed cell on server ITL (its prefill steps count). "
             f"Interval: {CONFIDENCE:.0%} bootstrap over the ABBA pairs. Verdict against {TARGET}: faster "
             f"(interval above 1), meets target (at or above {TARGET}), below target, or inconclusive (the "
             f"interval spans {TARGET}). Pairs: run k of B against run k of A, lowest and highest. Twin: "
             "A against C, a third server identical to A (the projection on too), on the judged metric: the null "
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
        lines.append(f"| {name} | {METRICS[key][0]} | {fmt(a.get(key), '.3f')} | {fmt(b.get(key), '.3f')} | "
                     f"{fmt(c.get(ratio_key), '.3f')} | {span(c.get('judged_interval'), ' - ')} | "
                     f"{span(c.get(f'{ratio_key}_range'))} | {fmt(c.get('twin_ratio'), '.3f')} | "
                     f"{span(c.get('twin_interval'), ' - ')} | "
                     f"{'+'.join(str(c[x]['runs']) for x in FLAGS if x in c)} | "
                     f"{c.get('verdict', '-')} | {'; '.join(c['flags']) or 'ok'} |")
    lines += ["", "Every metric (medians of the runs; ratio > 1: A faster):", "",
              "| cell | A TPOT ms | B TPOT ms | ratio | A median ITL ms | B median ITL ms | ratio | A server ITL ms "
              "| B server ITL ms | ratio | A tok/s | B tok/s | ratio |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, c in cells.items():
        a, b = c["A"], c["B"]
        lines.append(f"| {name} | {fmt(a.get('tpot_ms'), '.3f')} | {fmt(b.get('tpot_ms'), '.3f')} | "
                     f"{fmt(c.get('tpot_ratio'), '.3f')} | {fmt(a.get('itl_median_ms'), '.3f')} | "
                     f"{fmt(b.get('itl_median_ms'), '.3f')} | {fmt(c.get('itl_median_ratio'), '.3f')} | "
                     f"{fmt(a.get('server_itl_ms'), '.3f')} | {fmt(b.get('server_itl_ms'), '.3f')} | "
                     f"{fmt(c.get('server_itl_ratio'), '.3f')} | {fmt(a.get('decode_tok_s'), '.0f')} | "
                     f"{fmt(b.get('decode_tok_s'), '.0f')} | {fmt(c.get('tok_s_ratio'), '.3f')} |")
    mixed = cells.get("mixed")
    if mixed and mixed.get("total_tok_s_ratio") is not None:
        lines += ["", f"mixed: total throughput (decode + prefill prompt tokens) A "
                      f"{fmt(mixed['A']['total_tok_s'], '.0f')} tok/s, B {fmt(mixed['B']['total_tok_s'], '.0f')} "
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
    faster = "A (the series) faster" if s.get("b_tree") or s.get("b_site") else "project-before-merge faster"
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
    """An ``engine.json``, gzipped or not (the docs keep large ones as ``engine.json.gz``), read bounded
    (:mod:`overlay.jsonfile`, decompressed too); a ``ValueError`` (or gzip's ``EOFError``) says what is wrong."""
    import gzip
    import io

    try:
        raw = jsonfile.read_bytes(path, _NotAResult, "an engine.json")
        if raw[:2] == b"\x1f\x8b":
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as gz:
                raw = gz.read(jsonfile.LIMIT + 1)
            if len(raw) > jsonfile.LIMIT:
                raise _NotAResult(f"{path}: decompressed, larger than an engine.json may be ({jsonfile.LIMIT} bytes)")
        result = jsonfile.loads(raw, str(path), _NotAResult, "an engine.json", nonfinite=True)
    except _NotAResult as exc:
        raise ValueError(str(exc).removeprefix(f"{path}: ")) from None
    if not isinstance(result, dict) or "cells" not in result:
        raise ValueError("no 'cells' in it")
    if not isinstance(result["cells"], dict) or not isinstance(result.get("runs", []), list):
        raise ValueError("its 'cells' not an object or its 'runs' not a list")
    return result


class _NotAResult(OverlayError):
    pass


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


