"""Draw an engine check's results: each case's largest logprob deviation against the tolerance.

``overlay engine-plot RESULTS.json [MORE.json ...] --out engine.png`` (matplotlib, Agg;
run where matplotlib is, e.g. here after the device brought ``results.json`` back). Two bars per
case (the largest deviation from the DCP 1 reference where the context fits index_topk, the
90th percentile beyond it; log scale), the derived tolerances as lines, crashed or hung cases
marked; several result files (the main matrix and the seed-bug variants) side by side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

LEAST = 1e-4  # deviations of exactly 0 are drawn at this height (log scale)


def bars(doc: dict[str, Any]) -> list[tuple[str, float, float, str]]:
    """(case, dense max deviation, sparse 90th percentile, status) for every compared or failed case."""
    out: list[tuple[str, float, float, str]] = []
    for rec in doc["cases"]:
        if rec["case"]["role"] == "reference" or rec["status"] == "skipped":
            continue
        d = rec.get("diff") or {}
        label = f"variant: {rec['variant']}" if rec.get("variant") else rec["case"]["name"]
        out.append((label, d.get("dense_max_abs", 0.0), d.get("sparse_q90", 0.0),
                    rec["status"] if rec["status"] != "ok" else rec.get("verdict", "")))
    return out


def draw(docs: list[tuple[str, dict[str, Any]]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(docs), figsize=(max(6, 0.6 * sum(len(bars(d)) for _, d in docs) + 2), 7),
                             squeeze=False)
    for ax, (title, doc) in zip(axes[0], docs, strict=True):
        rows = bars(doc)
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [max(r[1], LEAST) for r in rows], 0.4, label="context <= index_topk: max")
        ax.bar([x + 0.2 for x in xs], [max(r[2], LEAST) for r in rows], 0.4, label="beyond: 90th percentile")
        tol = doc["summary"].get("tolerance")
        if tol:
            ax.axhline(tol["dense"], color="C0", linestyle="--", label=f"dense tolerance {tol['dense']:.3g}")
            ax.axhline(tol["sparse_q90"], color="C1", linestyle=":", label=f"p90 tolerance {tol['sparse_q90']:.3g}")
        for x, r in zip(xs, rows, strict=True):
            if r[3] in ("crashed", "timeout", "fail", "expected-fail"):
                ax.annotate(r[3], (x, LEAST * 2), ha="center", rotation=90, fontsize=7, color="darkred")
        ax.set_yscale("log")
        ax.set_xticks(list(xs), [r[0] for r in rows], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("max |logprob - reference| (nats)")
        ax.set_title(f"{title}: {doc['summary'].get('verdict', '?')}", fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.55), ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")  # the legend below the axes stays whole
    plt.close(fig)
    return out
