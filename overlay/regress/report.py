"""The report folder: ``report.json`` (everything), ``report.md`` (what a person reads) and PNGs.

Each check's part of ``report.md`` is its ``section`` function here, and its PNG its ``plot``
(``overlay.regress.plots``), both named by its line in :data:`overlay.regress.checks.CHECKS`, in
whose order they appear.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from overlay.build.fetch import recorded_path
from overlay.regress.checks import CHECKS, function
from overlay.regress.profiles import GSM8K_METRICS
from overlay.regress.results import RunReport

_ICON = {"pass": "PASS", "fail": "FAIL", "error": "ERROR", "skipped": "skipped"}


def in_run(value: Any, out: Path) -> Any:
    """``value`` with every absolute path in it (a string, in dicts and lists) as a record carries it: a file
    of the run's folder ``out`` relative to it (``server.log``, ``gsm8k/lm_eval.log``), any other as
    :func:`overlay.build.fetch.recorded_path` writes it (the repository's ``overlay/regress/profiles/x.yaml``)."""
    if isinstance(value, dict):
        return {k: in_run(v, out) for k, v in value.items()}
    if isinstance(value, list):
        return [in_run(v, out) for v in value]
    if isinstance(value, str) and value.startswith("/"):
        path, root = Path(value), out.resolve()
        if root in path.resolve().parents:
            return path.resolve().relative_to(root).as_posix()
        return recorded_path(path)
    return value


def to_dict(report: RunReport) -> dict[str, Any]:
    p = report.profile
    out = report.out_dir
    return {
        "verdict": report.verdict, "exit_code": report.exit_code, "profile": p.name,
        "profile_file": in_run(str(Path(p.path).absolute()), out) if p.path else p.path,
        "started": report.started, "seconds": round(report.seconds, 1), "base_url": report.base_url,
        "attached": report.attached, "server_command": p.server.command(), "server_env": p.server.env,
        "server_log": in_run(report.server_log, out), "baseline_source": p.baseline.source,
        "thresholds": {k: {"value": t.value, "why": t.why} for k, t in p.thresholds.items()},
        "steps": [in_run(s.to_dict(), out) for s in report.steps], "checks_off": dict(p.checks_off),
    }


def write_report(report: RunReport) -> tuple[Path, Path]:
    out = report.out_dir
    steps = {s.name: s for s in report.steps}
    images: dict[str, Path | None] = {}
    for c in CHECKS:
        if c.plot and c.name in steps:
            images[c.name] = function(c.plot)(report.profile, steps[c.name].data, out / f"{c.name}.png")
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
    for c in CHECKS:
        if c.section and c.name in steps:
            lines += function(c.section)(steps[c.name].data, images.get(c.name))
    lines += ["## Profile", "", f"`{p.path}`; baseline: {p.baseline.source}", "", "```",
              shlex.join(p.server.command()), "```", ""]
    if p.thresholds:
        lines += ["| threshold | value | why |", "| --- | ---: | --- |"]
        lines += [f"| {k} | {t.value:g} | {_cell(t.why)} |" for k, t in sorted(p.thresholds.items())]
        lines.append("")
    if report.server_log:
        lines += [f"Server log: `{report.server_log}`", ""]
    return "\n".join(lines)


def differential_section(data: dict[str, Any], image: Path | None) -> list[str]:
    if "diff" not in data:
        return []
    t, sp = data["tolerance"], data["spread"]
    lines = ["## Differential", "",
              f"Prompts of {', '.join(map(str, data['prompt_tokens']))} tokens, greedy, against `{data['reference']}`. "
              f"Tolerance (nats): every logprob with context <= index_topk {t['dense']:.3g} (reference spread "
              f"{sp['dense_max_abs']:.3g}); beyond, median {t['sparse_q50']:.3g} and 90th percentile "
              f"{t['sparse_q90']:.3g} (spread {sp['sparse_q50']:.3g} / {sp['sparse_q90']:.3g}).", "",
              "| request | prompt tokens | dense max (where) | beyond: median / p90 | steps compared | note |",
              "| ---: | ---: | --- | --- | ---: | --- |"]
    for i, r in enumerate(data["diff"]["requests"]):
        lines.append(f"| {i} | {r['prompt_len']} | {r['dense_max_abs']:.3g} ({r.get('dense_worst') or '-'}) | "
                     f"{r['sparse_q50']:.3g} / {r['sparse_q90']:.3g} | {r['steps_compared']} | "
                     f"{_cell(r.get('token_mismatch') or '')} |")
    lines.append("")
    return lines


def long_context_section(data: dict[str, Any], image: Path | None) -> list[str]:
    if not data:
        return []
    lines = ["## Long context", "",
              f"Prompts past index_topk {data['index_topk']} and the DCP workspace capacity "
              f"{data['workspace_capacity_tokens']} tokens, sent at once with the short decodes.", "",
              "| probe | prompt tokens | expected | answer (start) | duplicate 4-grams |",
              "| --- | ---: | --- | --- | ---: |"]
    for row in data["probes"]:
        answer = row.get("answer", row.get("error", ""))
        lines.append(f"| {row['name']} | {row.get('prompt_tokens', '')} | {_cell(row['expect'])} | "
                     f"{_cell(answer[:80])} | {row.get('repetition', '')} |")
    rep = data["repeated"]
    lines += ["", f"Asked in a row: *{rep['question']}* -> "
              + ", ".join(str(a["value"]) for a in rep["answers"]), ""]
    return lines


def gsm8k_section(data: dict[str, Any], image: Path | None) -> list[str]:
    if "strict-match" not in data:
        return []
    lines = ["## GSM8K", "", "| metric | this run | stderr | baseline | allowed minimum |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for m in GSM8K_METRICS:
        lines.append(f"| {m} | {data[m]['value']:.4f} | {data[m]['stderr']:.4f} | {data[m]['baseline']:.4f} | "
                     f"{data[m]['allowed_min']:.4f} |")
    lines += ["", f"{data.get('samples')} questions, task `{data.get('task')}`, lm-eval log `{data.get('log')}`.", ""]
    lines += _image(image, "GSM8K against baseline")
    return lines


def latency_section(data: dict[str, Any], image: Path | None) -> list[str]:
    if "mean_ttft_ms" not in data:
        return []
    lines = ["## Latency", "", "| metric | this run | baseline |", "| --- | ---: | ---: |",
              f"| mean TTFT (ms) | {data['mean_ttft_ms']:.2f} | {data['baseline']['mean_ttft_ms']:.2f} |",
              f"| mean TPOT (ms) | {data['mean_tpot_ms']:.2f} | {data['baseline']['mean_tpot_ms']:.2f} |", "",
              f"Measured with `{data['tool']}`; raw result `{data.get('result_file')}`.", ""]
    lines += _image(image, "TTFT and TPOT against baseline")
    return lines


def acceptance_section(data: dict[str, Any], image: Path | None) -> list[str]:
    if not data.get("rates"):
        return []
    lines = ["## Speculative-decoding acceptance", "", "| position | this run | healthy |",
              "| ---: | ---: | ---: |"]
    base = data.get("baseline") or []
    for i, r in enumerate(data["rates"]):
        lines.append(f"| {i} | {r:.3f} | {base[i] if i < len(base) else ''} |")
    lines.append("")
    lines += _image(image, "acceptance per position against the healthy curve")
    return lines


def _image(path: Path | None, alt: str) -> list[str]:
    return [f"![{alt}]({path.name})", ""] if path is not None else []


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")
