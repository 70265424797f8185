"""The report folder: ``report.json`` (everything), ``report.md`` (what a person reads) and PNGs."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from overlay.regress import plots
from overlay.regress.profiles import GSM8K_METRICS
from overlay.regress.results import RunReport

_ICON = {"pass": "PASS", "fail": "FAIL", "error": "ERROR", "skipped": "skipped"}


def to_dict(report: RunReport) -> dict[str, Any]:
    p = report.profile
    return {
        "verdict": report.verdict, "exit_code": report.exit_code, "profile": p.name, "profile_file": p.path,
        "started": report.started, "seconds": round(report.seconds, 1), "base_url": report.base_url,
        "attached": report.attached, "server_command": p.server.command(), "server_env": p.server.env,
        "server_log": report.server_log, "baseline_source": p.baseline.source,
        "thresholds": {k: {"value": t.value, "why": t.why} for k, t in p.thresholds.items()},
        "steps": [s.to_dict() for s in report.steps], "checks_off": dict(p.checks_off),
    }


def write_report(report: RunReport) -> tuple[Path, Path]:
    out = report.out_dir
    steps = {s.name: s for s in report.steps}
    images: dict[str, Path | None] = {}
    if "acceptance" in steps:
        images["acceptance"] = plots.acceptance_plot(report.profile, steps["acceptance"].data, out / "acceptance.png")
    if "gsm8k" in steps:
        images["gsm8k"] = plots.gsm8k_plot(report.profile, steps["gsm8k"].data, out / "gsm8k.png")
    if "latency" in steps:
        images["latency"] = plots.latency_plot(report.profile, steps["latency"].data, out / "latency.png")
    data = to_dict(report)
    data["plots"] = {k: v.name for k, v in images.items() if v is not None}
    json_path = out / "report.json"
    json_path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    md_path = out / "report.md"
    md_path.write_text(markdown(report, images), encoding="utf-8")
    return md_path, json_path


def markdown(report: RunReport, images: dict[str, Path | None]) -> str:
    p = report.profile
    lines = [f"# Regression: {p.name}", "",
             f"**Verdict: {report.verdict.upper()}** (exit {report.exit_code}) — {report.started}, "
             f"{report.seconds:.0f} s, server {report.base_url} ({'attached' if report.attached else 'started'})",
             "", f"{p.description}", ""]
    findings = [f for s in report.steps for f in s.findings]
    if findings:
        lines += ["## Findings", ""]
        lines += [f"- **{f.kind}** `{f.check}`: {f.message}" for f in findings]
        lines.append("")
    lines += ["## Checks", "", "| check | status | seconds | summary |", "| --- | --- | ---: | --- |"]
    for s in report.steps:
        lines.append(f"| {s.name} | {_ICON[s.status]} | {s.seconds:.1f} | {_cell(s.summary)} |")
    for name, why in p.checks_off.items():
        lines.append(f"| {name} | off | | {_cell(why)} |")
    lines.append("")
    steps = {s.name: s for s in report.steps}
    if "differential" in steps and "diff" in steps["differential"].data:
        d = steps["differential"].data
        t, sp = d["tolerance"], d["spread"]
        lines += ["## Differential", "",
                  f"Prompts of {', '.join(map(str, d['prompt_tokens']))} tokens, greedy, against `{d['reference']}`. "
                  f"Tolerance (nats): every logprob with context <= index_topk {t['dense']:.3g} (reference spread "
                  f"{sp['dense_max_abs']:.3g}); beyond, median {t['sparse_q50']:.3g} and 90th percentile "
                  f"{t['sparse_q90']:.3g} (spread {sp['sparse_q50']:.3g} / {sp['sparse_q90']:.3g}).", "",
                  "| request | prompt tokens | dense max (where) | beyond: median / p90 | steps compared | note |",
                  "| ---: | ---: | --- | --- | ---: | --- |"]
        for i, r in enumerate(d["diff"]["requests"]):
            lines.append(f"| {i} | {r['prompt_len']} | {r['dense_max_abs']:.3g} ({r.get('dense_worst') or '-'}) | "
                         f"{r['sparse_q50']:.3g} / {r['sparse_q90']:.3g} | {r['steps_compared']} | "
                         f"{_cell(r.get('token_mismatch') or '')} |")
        lines.append("")
    if "long_context" in steps and steps["long_context"].data:
        d = steps["long_context"].data
        lines += ["## Long context", "",
                  f"Prompts past index_topk {d['index_topk']} and the DCP workspace capacity "
                  f"{d['workspace_capacity_tokens']} tokens, sent at once with the short decodes.", "",
                  "| probe | prompt tokens | expected | answer (start) | duplicate 4-grams |",
                  "| --- | ---: | --- | --- | ---: |"]
        for row in d["probes"]:
            answer = row.get("answer", row.get("error", ""))
            lines.append(f"| {row['name']} | {row.get('prompt_tokens', '')} | {_cell(row['expect'])} | "
                         f"{_cell(answer[:80])} | {row.get('repetition', '')} |")
        rep = d["repeated"]
        lines += ["", f"Asked in a row: *{rep['question']}* -> "
                  + ", ".join(str(a["value"]) for a in rep["answers"]), ""]
    if "gsm8k" in steps and "strict-match" in steps["gsm8k"].data:
        d = steps["gsm8k"].data
        lines += ["## GSM8K", "", "| metric | this run | stderr | baseline | allowed minimum |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for m in GSM8K_METRICS:
            lines.append(f"| {m} | {d[m]['value']:.4f} | {d[m]['stderr']:.4f} | {d[m]['baseline']:.4f} | "
                         f"{d[m]['allowed_min']:.4f} |")
        lines += ["", f"{d.get('samples')} questions, task `{d.get('task')}`, lm-eval log `{d.get('log')}`.", ""]
        lines += _image(images.get("gsm8k"), "GSM8K against baseline")
    if "latency" in steps and "mean_ttft_ms" in steps["latency"].data:
        d = steps["latency"].data
        lines += ["## Latency", "", "| metric | this run | baseline |", "| --- | ---: | ---: |",
                  f"| mean TTFT (ms) | {d['mean_ttft_ms']:.2f} | {d['baseline']['mean_ttft_ms']:.2f} |",
                  f"| mean TPOT (ms) | {d['mean_tpot_ms']:.2f} | {d['baseline']['mean_tpot_ms']:.2f} |", "",
                  f"Measured with `{d['tool']}`; raw result `{d.get('result_file')}`.", ""]
        lines += _image(images.get("latency"), "TTFT and TPOT against baseline")
    if "acceptance" in steps and steps["acceptance"].data.get("rates"):
        d = steps["acceptance"].data
        lines += ["## Speculative-decoding acceptance", "", "| position | this run | healthy |",
                  "| ---: | ---: | ---: |"]
        base = d.get("baseline") or []
        for i, r in enumerate(d["rates"]):
            lines.append(f"| {i} | {r:.3f} | {base[i] if i < len(base) else ''} |")
        lines.append("")
        lines += _image(images.get("acceptance"), "acceptance per position against the healthy curve")
    lines += ["## Profile", "", f"`{p.path}`; baseline: {p.baseline.source}", "", "```",
              shlex.join(p.server.command()), "```", ""]
    if p.thresholds:
        lines += ["| threshold | value | why |", "| --- | ---: | --- |"]
        lines += [f"| {k} | {t.value:g} | {_cell(t.why)} |" for k, t in sorted(p.thresholds.items())]
        lines.append("")
    if report.server_log:
        lines += [f"Server log: `{report.server_log}`", ""]
    return "\n".join(lines)


def _image(path: Path | None, alt: str) -> list[str]:
    return [f"![{alt}]({path.name})", ""] if path is not None else []


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")
