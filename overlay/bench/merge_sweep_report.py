"""``make bench-merge``'s sweep, read: the grid printed, the threshold it implies per transport, ``merge.md``
and ``merge.png`` (per transport, projected / unprojected time against tokens) beside ``merge.json``.

A ratio below 1 means projecting through W_UV before the merge is faster than merging first. The
threshold a transport's sweep implies is the smallest token count of the grid from which every larger
one has a ratio below 1 (of ``first``, projecting first at every count, where the hook's own threshold
could be set; else of ``projected``, its policy); CUDA-graph times where the run has them, else eager.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

RATIOS = (("first", "projects first at every T"), ("projected", "the hook's own policy"))


def mode_of(result: dict[str, Any]) -> str:
    """The timing the verdicts read: CUDA-graph replay where the run has it, else eager."""
    return "graph" if "graph" in result["modes"] else "eager"


def ratio(row: dict[str, Any], order: str, mode: str) -> float | None:
    """``order``'s time over ``unprojected``'s in ``row`` (None where either was not timed)."""
    num, den = row.get(f"{order}_{mode}_us"), row.get(f"unprojected_{mode}_us")
    return num / den if num is not None and den else None


def implied(points: list[tuple[int, float]]) -> int | None:
    """The smallest token count from which every (count, ratio) of ``points`` has a ratio below 1; None
    when the largest does not."""
    found = None
    for tokens, r in sorted(points, reverse=True):
        if r >= 1.0:
            break
        found = tokens
    return found


def thresholds(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per transport: what the sweep says of projecting before the merge, and the threshold it implies."""
    mode = mode_of(result)
    out: dict[str, dict[str, Any]] = {}
    for transport, about in result["transports"].items():
        if not about.get("available"):
            out[transport] = {"threshold": None, "says": f"not available here: {about.get('why', '?')}"}
            continue
        if about.get("projection") is None:
            out[transport] = {"threshold": None, "says": "no v_up_proj_combine: the manager merges, then projects, "
                                                         "at every token count (nothing to compare)"}
            continue
        order = "first" if about.get("knob") else "projected"
        points = [(r["tokens"], x) for r in result["rows"]
                  if r["transport"] == transport and (x := ratio(r, order, mode)) is not None]
        found = implied(points)
        knob = about.get("knob")
        now = f"{knob['name']} = {knob['value']}" if knob else "no threshold constant found: its policy timed"
        if not points:
            says = "no timed row"
        elif found is None:
            says = f"merging first is as fast or faster at {max(t for t, _ in points)} tokens"
        else:
            says = f"projecting first is faster from {found} tokens on"
        out[transport] = {"threshold": found, "order": order, "mode": mode, "now": now, "says": says}
    return out


def _cell(row: dict[str, Any], key: str, width: int, fmt: str = ".1f") -> str:
    value = row.get(key)
    return f"{value:>{width}{fmt}}" if value is not None else f"{'-':>{width}}"


def table(result: dict[str, Any]) -> str:
    """The grid as text: per transport and token count each order's time and ratio, per timing mode."""
    head = f"{'transport':<11}{'T':>6}"
    for mode in result["modes"]:
        head += f" | {mode + ' unproj':>13}{'proj':>9}{'first':>9}{'proj/u':>8}{'first/u':>8}"
    head += f"{'max rel diff':>14}"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        line = f"{r['transport']:<11}{r['tokens']:>6}"
        if "error" in r:
            lines.append(f"{line}  error: {r['error'][:90]}")
            continue
        for mode in result["modes"]:
            rp, rf = ratio(r, "projected", mode), ratio(r, "first", mode)
            line += (f" | {_cell(r, f'unprojected_{mode}_us', 13)}{_cell(r, f'projected_{mode}_us', 9)}"
                     f"{_cell(r, f'first_{mode}_us', 9)}{_cell({'x': rp}, 'x', 8, '.2f')}"
                     f"{_cell({'x': rf}, 'x', 8, '.2f')}")
        diff = max((r[k] for k in ("projected_rel_diff", "first_rel_diff") if k in r), default=None)
        lines.append(line + _cell({"x": diff}, "x", 14, ".1e"))
    lines.append("")
    for transport, t in thresholds(result).items():
        lines.append(f"threshold {transport}: {t['says']}" + (f" (now: {t['now']})" if "now" in t else ""))
    return "\n".join(lines)


def markdown(result: dict[str, Any], png: str | None) -> str:
    """``merge.md``: the setup, the thresholds, and the grid."""
    d = result["dims"]
    lines = [
        f"# `make bench-merge`: merge-then-project against `v_up_proj_combine`, DCP {result['world']}",
        "",
        f"{result['device']}; GLM-5's dims: kv_lora_rank {d['kv_lora_rank']} -> v_head_dim {d['v_head_dim']}, "
        f"{result['heads_per_rank']} heads per rank (64 at TP{result['tp']}); the DCP workspace holds "
        f"{result['workspace_tokens']} tokens (max_num_seqs {result['max_num_seqs']}); token grid "
        f"{', '.join(map(str, result['tokens']))}; times per call, the slower rank's median of "
        f"{result['options']['replays']} samples of {result['options']['inner']} calls "
        f"({', '.join(result['modes'])}). Ratios are projected / unprojected time: below 1, projecting first pays.",
        "",
        "| transport | combine | projection | threshold now | the sweep says | implied threshold |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for transport, t in thresholds(result).items():
        about = result["transports"][transport]
        lines.append(f"| {transport} | {about.get('combine', '-')} | {about.get('projection') or '-'} | "
                     f"{t.get('now', '-')} | {t['says']} | {t['threshold'] if t['threshold'] is not None else '-'} |")
    if png:
        lines += ["", f"![projected / unprojected against tokens]({png})"]
    lines += ["", "```text", table(result), "```", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], png: Path) -> bool:
    """Per transport with a projection, both ratios against tokens (log 2), to ``png``; False when none has one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mode = mode_of(result)
    shown = [t for t, a in result["transports"].items() if a.get("available") and a.get("projection")]
    if not shown:
        return False
    fig, axes = plt.subplots(1, len(shown), figsize=(max(7.0, 5.5 * len(shown)), 4.4), squeeze=False)
    for ax, transport in zip(axes[0], shown, strict=True):
        rows = [r for r in result["rows"] if r["transport"] == transport]
        for i, (order, label) in enumerate(RATIOS):
            pts = [(r["tokens"], x) for r in rows if (x := ratio(r, order, mode)) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o" if i == 0 else "--s", label=label)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axvline(result["workspace_tokens"], color="gray", lw=0.8, ls=":", label="DCP workspace")
        knob = result["transports"][transport].get("knob")
        if knob:
            # a label starting with "_" is hidden from the legend: say what the line is first
            ax.axvline(knob["value"], color="C3", lw=0.8, ls="--",
                       label=f"threshold now: {knob['name']} = {knob['value']}")
        ax.set(xlabel="tokens T", ylabel=f"projected / unprojected ({mode})", title=transport)
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["tokens"], [str(t) for t in result["tokens"]], fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"W_UV before the DCP merge: DCP {result['world']}, {result['heads_per_rank']} heads/rank\n"
                 f"{result['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


def finish(json_path: Path) -> dict[str, Any]:
    """A sweep's ``merge.json`` (rank 0's) completed with its thresholds, and the outputs beside it."""
    import json

    result = json.loads(json_path.read_text())
    result["thresholds"] = thresholds(result)
    json_path.write_text(json.dumps(result, indent=1))
    write_outputs(result, json_path.parent)
    return result


def write_outputs(result: dict[str, Any], out_dir: Path) -> None:
    """``merge.txt``, ``merge.png`` and ``merge.md`` beside ``merge.json``; the grid printed."""
    text = table(result)
    (out_dir / "merge.txt").write_text(text + "\n")
    print(text)
    png: str | None = None
    try:
        if plot(result, out_dir / "merge.png"):
            png = "merge.png"
            print(f"plot: {out_dir / png}")
    except ImportError:
        print("matplotlib missing here: draw the plot later with --plot merge.json")
    (out_dir / "merge.md").write_text(markdown(result, png))
    print(f"report: {out_dir / 'merge.md'}")
