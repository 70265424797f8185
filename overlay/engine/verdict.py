"""An engine check's verdict: each case judged against its reference, and the report that shows it.

:func:`judge` derives the tolerance from the DCP 1 spread runs (``engine.compare.derive_tolerance``)
and gives every case its verdict: compared with its reference within that tolerance, greedy tokens
included; the settings its engine resolved and the CUDA graphs its log shows held to what the case
says it runs; a seed-bug variant's job held to the way it must fail (``--expect``). :func:`report`
writes ``results.json`` (machines) and ``REPORT.md`` (people). ``engine.check`` runs the jobs and
calls both after every case, and again on ``--rejudge``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from overlay import jsonfile
from overlay.engine.compare import FLOOR, SAFETY, compare, derive_tolerance
from overlay.engine.liveness_run import problems as liveness_problems
from overlay.engine.liveness_run import table as liveness_table
from overlay.errors import OverlayError, shown_value
from overlay.outpaths import check_name
from overlay.releases.engine_cases import case_problem
from overlay.releases.facts import ReleaseFacts

RESULTS = "an engine check's results.json"
# the fields of a case's record in results.json, as :func:`report` writes them
RECORD_FIELDS: dict[str, type | tuple[type, ...]] = {
    "name": str, "status": str, "error": str, "verdict": str, "variant": str, "expect": str, "reused": str,
    "wall_s": float, "rc": int, "startup_s": float, "generate_s": float, "graphs": dict, "diff": dict,
    "spec_decode": dict, "resolved": dict, "problems": list, "liveness": dict, "log_lines": list}


def record_name(record: dict[str, Any]) -> str:
    """A record's job name (a variant's job: ``variant--case``), else its case's."""
    return record.get("name") or record["case"]["name"]


def read_results(path: Path, error: type[OverlayError]) -> dict[str, Any]:
    """An engine check's ``results.json`` (``--rejudge``, ``engine-plot``), read bounded (:mod:`overlay.jsonfile`)
    and held to what :func:`report` writes: ``cases`` a list of records, each with its case and status, every
    field of its type, its name one file name (it names the record's ``.json`` and ``.log`` beside it);
    ``error`` naming the file and the field otherwise."""
    doc = jsonfile.read(path, error, RESULTS, nonfinite=True)  # a diff against a -inf logprob is inf
    src = str(path)
    jsonfile.get(doc, "meta", dict, "", src, error)
    summary = jsonfile.get(doc, "summary", dict, "", src, error, {})
    jsonfile.get(summary, "verdict", str, "summary", src, error)
    tolerance = jsonfile.get(summary, "tolerance", dict, "summary", src, error, {})
    for key in ("dense", "sparse_q90"):
        jsonfile.get(tolerance, key, float, "summary.tolerance", src, error)
    for i, rec in enumerate(jsonfile.need(doc.get("cases"), list, "cases", src, error, RESULTS)):
        where = f"cases[{i}]"
        jsonfile.need(rec, dict, where, src, error)
        case = jsonfile.need(rec.get("case"), dict, f"{where}.case", src, error)
        if problem := case_problem(case):
            raise error(f"{src}: {where}.case.{problem}")
        jsonfile.need(case.get("role"), str, f"{where}.case.role", src, error)
        jsonfile.need(rec.get("status"), str, f"{where}.status", src, error)
        for key, kind in RECORD_FIELDS.items():
            jsonfile.get(rec, key, kind, where, src, error)
        for key in ("dense_max_abs", "sparse_q90"):
            jsonfile.get(rec.get("diff") or {}, key, float, f"{where}.diff", src, error)
        try:
            check_name(record_name(rec))
        except ValueError as exc:
            raise error(f"{src}: {where}: its name {shown_value(record_name(rec))} is not one file "
                        f"name ({exc})") from None
    return doc


def judge(records: list[dict[str, Any]], out: Path, expect: str | None) -> dict[str, Any]:
    """Tolerance from the spread runs, then a verdict per case (``pass`` / ``fail`` / ``expected-fail`` /
    ``expected-pass``: a variant whose fix does nothing on this build).

    A record with its own ``expect`` (a variant job) must fail that way; ``expect`` here applies
    to every other checked case (a run on one variant tree).
    """
    docs = {record_name(r): jsonfile.read(out / f"{record_name(r)}.json", OverlayError, "an engine case's output",
                                           nonfinite=True)
            for r in records if r["status"] == "ok"}
    ref_rec = next((r for r in records if r["case"]["role"] == "reference" and not r.get("variant")), None)
    summary: dict[str, Any] = {"safety": SAFETY, "floor": FLOOR, "expect": expect}
    if ref_rec is None or ref_rec["status"] != "ok":
        summary["verdict"] = "harness"
        summary["why"] = f"reference did not run: {ref_rec['error'] if ref_rec else 'not in the case list'}"
        for r in records:
            r["verdict"] = "n/a"
        return summary
    ref = docs[record_name(ref_rec)]
    spreads = [docs[record_name(r)] for r in records if r["case"]["role"] == "spread" and r["status"] == "ok"]
    tol, spread = derive_tolerance(ref, spreads)
    summary |= {"tolerance": tol.to_dict(), "spread": spread, "spread_runs": len(spreads)}
    # other references (``compare_to``): a case is compared with the run that differs from it
    # only in what the case tests (the MTP cases with DCP 1 + MTP)
    refs = {record_name(r): r for r in records if r["case"]["role"] == "reference" and not r.get("variant")}
    failed = False
    for r in records:
        name, role = record_name(r), r["case"]["role"]
        r["startup_s"] = docs.get(name, {}).get("startup_s")
        r["generate_s"] = docs.get(name, {}).get("generate_s")
        if r is ref_rec:
            r["verdict"] = "reference"
            if (lost := liveness_problems(r)):  # --coverage: a patch it declares ran none of its lines
                r["problems"], r["verdict"], failed = lost, "fail", True
            continue
        base = r["case"].get("compare_to") or record_name(ref_rec)
        # another workload's reference (the long cases'): nothing of the first to compare it with
        own_workload = r["case"].get("prompt_lens") != ref_rec["case"].get("prompt_lens")
        problems: list[str]
        if r["status"] == "ok" and role == "reference" and own_workload and not r["case"].get("compare_to"):
            problems = []
        elif r["status"] != "ok":
            problems = [f"{r['status']}: {r['error']}"]
        elif base not in refs or refs[base]["status"] != "ok":
            problems = [f"its reference {base} did not run"]
        else:
            d = compare(docs[base], docs[name], tol)
            r["diff"] = d.to_dict()
            r["spec_decode"] = docs[name].get("spec_decode") or {}
            problems = d.problems(tol)
        resolved = docs.get(name, {}).get("resolved")
        if resolved is not None:
            r["resolved"] = resolved
        problems += resolve_problems(r["case"].get("resolves") or {}, resolved) if r["status"] == "ok" else []
        problems += liveness_problems(r)
        wanted_graphs = r["case"].get("graphs")
        seen_graphs = (r.get("graphs") or {}).get("mode")
        if r["status"] == "ok" and wanted_graphs and seen_graphs is not None and seen_graphs != wanted_graphs:
            problems.append(f"graphs: expected {wanted_graphs} decode graphs, the log shows "
                            f"{seen_graphs or 'no capture'}")
        seen_lines = r.get("log_lines")
        if r["status"] == "ok" and seen_lines is not None:
            problems += [f"log: no line with {w!r}" for w in r["case"].get("log_lines") or [] if w not in seen_lines]
        r["problems"] = problems
        wanted = r.get("expect") if r.get("variant") else (expect if role == "check" else None)
        if role == "reference" and not r.get("variant"):
            # a second reference (DCP 1 + MTP) is judged against the first too: MTP moved the first
            # request's prompt logprobs at DCP 1 before spec-decode-prompt-logprobs-graph-pool
            r["verdict"] = "reference" if r["status"] == "ok" and not problems else "fail"
        elif r.get("variant") or (wanted and role == "check"):
            label = "expected-pass" if wanted == "pass" else "expected-fail"
            r["verdict"] = label if wanted and _matches(wanted, r) else "fail"
        elif role == "spread":
            r["verdict"] = "spread" if r["status"] == "ok" else "fail"
        else:
            r["verdict"] = "fail" if problems else "pass"
        failed |= r["verdict"] == "fail"
    summary["verdict"] = "fail" if failed else "pass"
    return summary


def resolve_problems(wanted: dict[str, Any], resolved: dict[str, Any] | None) -> list[str]:
    """What a case's engine resolved differently from what the case says it runs (``Case.resolves``)."""
    if not wanted:
        return []
    if resolved is None:
        return ["resolved: the run recorded no resolved settings"]
    return [f"resolved: {key}={resolved.get(key)!r}, the case runs {value!r}"
            for key, value in wanted.items() if resolved.get(key) != value]


def _matches(expect: str, record: dict[str, Any]) -> bool:
    kind, _, pattern = expect.partition(":")
    if kind == "pass":  # the fix does nothing on this build: without it the case still passes
        return record["status"] == "ok" and not record["problems"]
    if kind == "crash":
        return record["status"] == "crashed" and bool(re.search(pattern, record["error"] or ""))
    if kind == "mismatch":
        return record["status"] == "ok" and bool(record["problems"])
    raise ValueError(f"--expect: unknown kind {kind!r} (crash:REGEX, mismatch or pass)")


def report(out: Path, summary: dict[str, Any], records: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """``results.json`` (machines) and ``REPORT.md`` (people), rewritten after every case."""
    doc = {"meta": meta, "summary": summary, "cases": records}
    (out / "results.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    lines = [f"# Engine check: {summary.get('verdict', '?')}", ""]
    for k in ("model", "tree", "vllm", "torch", "gpus", "parallel", "started", "wall_s", "liveness"):
        if meta.get(k):
            lines.append(f"- {k}: `{meta[k]}`")
    if isinstance(meta.get("release_facts"), dict):
        lines.append(f"- release facts: {ReleaseFacts.from_dict(meta['release_facts']).summary()}")
    if "tolerance" in summary:
        t, sp = summary["tolerance"], summary["spread"]
        lines.append(f"- tolerance (nats; max({SAFETY:g} x the DCP 1 spread, floor {FLOOR:g}), from "
                     f"{summary['spread_runs']} spread run(s)): context <= index_topk, every logprob "
                     f"{t['dense']:.4g} (spread {sp['dense_max_abs']:.4g}); beyond, median {t['sparse_q50']:.4g} "
                     f"(spread {sp['sparse_q50']:.4g}) and 90th percentile {t['sparse_q90']:.4g} "
                     f"(spread {sp['sparse_q90']:.4g})")
    if summary.get("why"):
        lines.append(f"- {summary['why']}")
    lines += ["", "| case | role | status | verdict | dense max / sparse median / sparse p90 (nats) | start s | gen s "
                  "| note |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        d = r.get("diff") or {}
        dl = f"{d['dense_max_abs']:.3g} / {d['sparse_q50']:.3g} / {d['sparse_q90']:.3g}" if d else ""
        role = f"variant, expect {r['expect']}" if r.get("variant") else r["case"]["role"]
        note = "; ".join(r.get("problems") or []) or r["case"].get("note", "")
        graphs = (r.get("graphs") or {}).get("mode")
        if graphs:
            note = f"graphs {graphs}; {note}"
        lines.append(f"| {record_name(r)} | {role} | {r['status']} | {r.get('verdict', '')} | {dl} "
                     f"| {r.get('startup_s') or ''} | {r.get('generate_s') or ''} | {note[:300]} |")
    lines += liveness_table(records)
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")
