"""PNG plots for the report (matplotlib, Agg backend: no display needed).

Each function takes a step's JSON data and writes one PNG, returning its path, or None when the
step has nothing to plot (skipped, or failed before measuring).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use("Agg"): the backend must be chosen first

from overlay.regress.profiles import GSM8K_METRICS, Profile


def acceptance_plot(profile: Profile, data: dict[str, Any], path: Path) -> Path | None:
    rates = data.get("rates") or []
    baseline = data.get("baseline") or []
    if not rates:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(range(len(baseline)), baseline, "o--", color="tab:green", label="healthy baseline")
    if baseline and "acceptance_max_drop" in profile.thresholds:
        drop = profile.threshold("acceptance_max_drop")
        ax.fill_between(range(len(baseline)), [max(0, b - drop) for b in baseline], baseline,
                        color="tab:green", alpha=0.12, label=f"allowed drop ({drop})")
    ax.plot(range(len(rates)), rates, "o-", color="tab:blue", label="this run")
    if "acceptance_near_one" in profile.thresholds:
        ax.axhline(profile.threshold("acceptance_near_one"), color="tab:red", lw=0.8, ls=":",
                   label="near 1.0 (collapse)")
    ax.set_xticks(range(max(len(rates), len(baseline))))
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05),
           title=f"Acceptance per position ({data.get('drafts', 0):.0f} drafts)")
    ax.legend(loc="lower left", fontsize=8)
    return _save(fig, path)


def gsm8k_plot(profile: Profile, data: dict[str, Any], path: Path) -> Path | None:
    metrics = [m for m in GSM8K_METRICS if isinstance(data.get(m), dict)]
    if not metrics:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4))
    x = range(len(metrics))
    base = [profile.baseline.gsm8k[m] for m in metrics]
    got = [data[m]["value"] for m in metrics]
    ax.bar([i - 0.2 for i in x], base, 0.4, yerr=[profile.baseline.gsm8k_stderr] * len(metrics), capsize=4,
           color="tab:green", alpha=0.7, label="baseline (±1 stderr)")
    ax.bar([i + 0.2 for i in x], got, 0.4, yerr=[data[m]["stderr"] for m in metrics], capsize=4,
           color="tab:blue", alpha=0.8, label="this run (±1 stderr)")
    for i, m in enumerate(metrics):
        floor = data[m].get("allowed_min")
        if floor is not None:
            ax.hlines(floor, i - 0.45, i + 0.45, colors="tab:red", linestyles=":",
                      label="allowed minimum" if i == 0 else None)
    ax.set_xticks(list(x), metrics)
    low = min([*base, *got]) - 0.1
    ax.set(ylabel="exact match", ylim=(max(0.0, low), 1.02),
           title=f"GSM8K {profile.gsm8k.num_fewshot}-shot ({data.get('samples') or '?'} questions)")
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def latency_plot(profile: Profile, data: dict[str, Any], path: Path) -> Path | None:
    if "mean_ttft_ms" not in data:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.6))
    for ax, key, threshold, title in ((axes[0], "mean_ttft_ms", "ttft_max_ratio", "mean TTFT (ms)"),
                                       (axes[1], "mean_tpot_ms", "tpot_max_ratio", "mean TPOT (ms)")):
        base = data["baseline"][key]
        ax.bar(["baseline", "this run"], [base, data[key]], color=["tab:green", "tab:blue"], alpha=0.8)
        if threshold in profile.thresholds:
            ax.axhline(base * profile.threshold(threshold), color="tab:red", ls=":",
                       label=f"limit x{profile.threshold(threshold):g}")
            ax.legend(fontsize=8)
        ax.set_title(title)
    fig.suptitle(f"Latency ({data.get('tool')}: {profile.latency.input_len} in / {profile.latency.output_len} out)")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
