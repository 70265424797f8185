"""0.34.0 over 0.28.0 per cell, from the bench-engine runs of this record: ratios.json and ratios.png.

    .venv/bin/python docs/records/engine/0.34.0-vs-0.28.0-1gpu-2026-12-06/ratios.py

A = 0.34.0 (and its twin C), B = 0.28.0 (``--b-site``). Per cell and metric: the ratio of the medians of
each server's measured runs, 0.34.0 over 0.28.0 (ITL: < 1 is 0.34.0 faster; tok/s: > 1 is 0.34.0 faster),
with bench-engine's own 95% bootstrap over the pairs (run k of A with run k of B), and the same for the
twin (C over A: two identical 0.34.0 servers, the method's null in the same run)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))

from overlay.bench.engine.common import KEPT_UP_MIN  # noqa: E402
from overlay.bench.engine.stats import median_or_none, ratio_interval  # noqa: E402

RUNS = {"plain decode": "engine-plain.json.gz", "MTP-5, FULL graphs": "engine-mtp.json.gz"}
METRICS = {"itl_median_ms": ("median ITL", True), "decode_tok_s": ("throughput (tok/s)", False)}


def load(name: str) -> dict:
    return json.loads(gzip.decompress((HERE / name).read_bytes()))


def over(new: list, old: list, lower: bool, seed: str) -> tuple[float | None, list[float] | None]:
    """new over old (times and rates alike), with ratio_interval's bootstrap over the pairs."""
    mn, mo = median_or_none(new), median_or_none(old)
    point = mn / mo if mn and mo else None
    # ratio_interval(a, b, lower) is median(b)/median(a) for times and median(a)/median(b) for rates
    iv = ratio_interval(old, new, True, seed) if lower else ratio_interval(new, old, False, seed)
    return point, iv


def main() -> None:
    out: dict = {"a": "0.34.0", "b": "0.28.0", "meaning": "ratio = 0.34.0 / 0.28.0 of per-server medians; "
                 "interval: 95% bootstrap over the ABBA pairs; twin = C / A, both 0.34.0", "modes": {}}
    for mode, name in RUNS.items():
        path = HERE / name
        if not path.is_file():
            continue
        res = load(name)
        mode_out = {"source": name, "gpu": res.get("gpu"), "versions": res.get("versions"),
                    "partial": res.get("partial"), "cells": {}}
        for cell, c in res["cells"].items():
            kept_up = (c.get("single_token_chunks_min") or 0.0) >= KEPT_UP_MIN
            row = {"runs": {s: c[s]["runs"] for s in ("A", "B", "C") if s in c},
                   "readable": kept_up,  # else the client bundled tokens: its gaps are not step times
                   "single_token_chunks_min": c.get("single_token_chunks_min"),
                   "cached_fraction_min": c.get("cached_fraction_min")}
            for key, (_label, lower) in METRICS.items():
                a, b = c["A"][f"{key}_runs"], c["B"][f"{key}_runs"]
                point, iv = over(a, b, lower, f"{cell}:{key}")
                row[key] = {"0.34.0": c["A"][key], "0.28.0": c["B"][key], "ratio": point, "interval": iv}
                if "C" in c:
                    tp, tiv = over(c["C"][f"{key}_runs"], a, lower, f"{cell}:{key}:twin")
                    row[key]["twin"] = tp
                    row[key]["twin_interval"] = tiv
            mode_out["cells"][cell] = row
        out["modes"][mode] = mode_out
    (HERE / "ratios.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(out)


def plot(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for ax, (key, (label, lower)) in zip(axes, METRICS.items(), strict=True):
        xs, names, lows, highs = [], [], [], []
        x = 0
        for mi, (mode, m) in enumerate(out["modes"].items()):
            for cell, row in m["cells"].items():
                r = row[key]
                if r["ratio"] is None or not row["readable"]:
                    continue
                iv = r["interval"] or [r["ratio"], r["ratio"]]
                ax.bar(x - 0.18, r["ratio"], width=0.36, color=f"C{mi}",
                       yerr=[[r["ratio"] - iv[0]], [iv[1] - r["ratio"]]], capsize=3,
                       label=f"0.34.0 / 0.28.0, {mode}" if cell == next(iter(m["cells"])) else None)
                if r.get("twin"):
                    tiv = r["twin_interval"] or [r["twin"], r["twin"]]
                    ax.errorbar([x + 0.18], [r["twin"]], yerr=[[r["twin"] - tiv[0]], [tiv[1] - r["twin"]]],
                                fmt="D", color="grey", capsize=3,
                                label="twin C / A (0.34.0 / 0.34.0: null)" if x == 0 else None)
                lows.append(iv[0])
                highs.append(iv[1])
                ax.annotate(f"{r['ratio']:.3f}", (x - 0.18, iv[1]), ha="center", va="bottom", fontsize=7)
                xs.append(x)
                names.append(f"{cell}\n{mode.split(',')[0]}")
                x += 1
            x += 0.5
        ax.axhline(1.0, color="black", linewidth=0.7)
        ax.set_ylim(0.0, max(1.2, *highs) * 1.12)
        ax.set_xticks(xs, names, fontsize=7)
        better = "< 1: 0.34.0 faster" if lower else "> 1: 0.34.0 faster"
        ax.set(title=f"decode {label}, 0.34.0 over 0.28.0", ylabel=f"ratio ({better})",
               xlabel="cell (batch x context tokens)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left" if not lower else "upper right")
    gpu = next((m.get("gpu") for m in out["modes"].values() if m.get("gpu")), "")
    fig.suptitle(f"tiny GLM-5 (random weights), TP1 x DCP1, {gpu}: both releases served side by side, "
                 "one run per mode\n"
                 "95% bootstrap intervals over the pairs; cells where the client bundled tokens left out; "
                 "0.28.0 ran without cuteDSL (README)", fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "ratios.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
