"""The engine check: run the cases of ``engine.workload`` as real vLLM engines, compare, report.

``python -m overlay.engine.check --out DIR [--model DIR] [--tp 2] [--cases a,b] [--timeout S]
[--budget S] [--tree DIR] [--expect KIND[:REGEX]]`` on a GPU machine where the patched vLLM
imports (the device: ``scripts/device-run.sh``). Each case runs in its own process group
(``engine.run_case``) under a timeout, with the test-only ``deep_gemm`` stand-in
(``tests/engine/standin``) first on ``PYTHONPATH`` and NVLink multicast off. The DCP 1
reference and spread runs come first; the tolerance is derived from them
(``engine.compare.derive_tolerance``); every other case must match the reference within it,
greedy tokens included, and must not crash or hang.

``--tree DIR`` puts another vLLM tree first on the children's ``PYTHONPATH`` (a seed-bug
variant: the series minus one fix); with ``--expect crash:REGEX`` or ``--expect mismatch`` the
non-reference cases are then expected to fail that way, and the check passes when they do.

Writes ``DIR/results.json`` and ``DIR/REPORT.md`` after every case (a run cut short keeps what
it measured), and each case's log as ``DIR/<case>.log``. Exit 0: every case as expected;
1: a case failed; 2: the reference itself failed (nothing could be compared).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from overlay.engine.compare import FLOOR, SAFETY, compare, derive_tolerance
from overlay.engine.workload import Case, cases

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "tests" / "engine" / "standin"
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_ERROR_LINE = re.compile(r"(\b\w*(Error|Exception)\b[:(]|token count exceeds|Traceback)")


def error_line(log: str) -> str:
    """The most telling line of a failed run's log: the last exception line, else the last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    hits = [ln for ln in lines if _ERROR_LINE.search(ln) and not ln.startswith("Traceback")
            and not re.search(r"\braise \w+\($", ln)]  # the source line of a multi-line raise
    if hits:
        # vLLM re-raises a worker's error in the engine core and the driver: the worker's line names
        # the cause; else the last line that is not one of the generic wrappers.
        worker = [h for h in hits if h.startswith("(Worker")]
        generic = ("Engine core initialization failed", "EngineDeadError", "WorkerProc initialization failed",
                   "Worker failed with error")
        specific = [h for h in hits if not any(g in h for g in generic)]
        return _strip_log_prefix((worker or specific or hits)[-1])[:400]
    return lines[-1][:400] if lines else "(no output)"


def _strip_log_prefix(line: str) -> str:
    """``(Worker_TP0 pid=1) ERROR 11-30 13:03:01 [file.py:1] RuntimeError: x`` -> ``RuntimeError: x``."""
    m = re.search(r"\b\w*(Error|Exception)\b[:(].*", line)
    return m.group(0) if m else line


def child_env(case: Case, tree: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(case.env)
    env.update(SAFE_ENV)
    paths = [str(STANDIN), str(REPO)]
    if tree is not None:
        paths.insert(0, str(tree))
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Start-up: the CUDA-graph memory estimate took 93 s of a cold 268 s start on two H200s
    # (the check's engines use 35% of the GPU; memory accounting is not what it checks).
    env.setdefault("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "0")
    return env


def run_one(case: Case, model: Path, out: Path, timeout: float, tree: Path | None) -> dict[str, Any]:
    """Run ``case`` in a child process group; return its status record (and write its outputs)."""
    case_file = out / f"{case.name}.case.json"
    case_file.write_text(json.dumps(case.to_dict()))
    result_file = out / f"{case.name}.json"
    log_file = out / f"{case.name}.log"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "overlay.engine.run_case", "--case", str(case_file), "--model", str(model),
           "--out", str(result_file)]
    t0 = time.monotonic()
    print(f"[engine-check] {case.name}: starting (timeout {timeout:.0f} s)", flush=True)
    with log_file.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(case, tree),
                                cwd=REPO, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _kill_group(proc)
    wall = round(time.monotonic() - t0, 1)
    text = log_file.read_text(errors="replace")
    if rc is None:
        status, why = "timeout", f"no result within {timeout:.0f} s; last line: {error_line(text)}"
    elif rc != 0 or not result_file.exists():
        status, why = "crashed", error_line(text)
    else:
        status, why = "ok", ""
    print(f"[engine-check] {case.name}: {status} in {wall} s{': ' + why if why else ''}", flush=True)
    return {"case": case.to_dict(), "status": status, "error": why, "wall_s": wall, "rc": rc}


def lay_variant(tar: Path, dest: Path) -> Path:
    """A vLLM tree at ``dest`` that is the importable ``vllm`` with the files of ``tar`` swapped in.

    Every other file is a symlink into the installed package (compiled kernels included), so
    a variant costs a few hundred kilobytes. Returns ``dest`` (put it first on ``PYTHONPATH``).
    """
    import importlib.util
    import shutil
    import tarfile

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("error: --variant needs an importable vllm to lay the variant over")
    src = Path(spec.origin).parent
    if dest.exists():
        shutil.rmtree(dest)
    for path in src.rglob("*"):
        if "__pycache__" in path.parts or path.is_dir():
            continue
        link = dest / "vllm" / path.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path)
    with tarfile.open(tar) as tf:
        for member in tf.getmembers():
            if not member.isfile() or not member.name.startswith("vllm/") or ".." in Path(member.name).parts:
                raise SystemExit(f"error: {tar}: unexpected member {member.name!r}")
            target = dest / member.name
            target.unlink(missing_ok=True)
            target.parent.mkdir(parents=True, exist_ok=True)
            data = tf.extractfile(member)
            assert data is not None
            target.write_bytes(data.read())
    return dest


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def judge(records: list[dict[str, Any]], out: Path, expect: str | None) -> dict[str, Any]:
    """Tolerance from the spread runs, then a verdict per case (``pass`` / ``fail`` / ``expected-fail``)."""
    docs = {r["case"]["name"]: json.loads((out / f"{r['case']['name']}.json").read_text())
            for r in records if r["status"] == "ok"}
    ref_rec = next((r for r in records if r["case"]["role"] == "reference"), None)
    summary: dict[str, Any] = {"safety": SAFETY, "floor": FLOOR, "expect": expect}
    if ref_rec is None or ref_rec["status"] != "ok":
        summary["verdict"] = "harness"
        summary["why"] = f"reference did not run: {ref_rec['error'] if ref_rec else 'not in the case list'}"
        for r in records:
            r["verdict"] = "n/a"
        return summary
    ref = docs[ref_rec["case"]["name"]]
    spreads = [docs[r["case"]["name"]] for r in records if r["case"]["role"] == "spread" and r["status"] == "ok"]
    tol, spread = derive_tolerance(ref, spreads)
    summary |= {"tolerance": tol.to_dict(), "spread": spread, "spread_runs": len(spreads)}
    failed = False
    for r in records:
        name, role = r["case"]["name"], r["case"]["role"]
        r["startup_s"] = docs.get(name, {}).get("startup_s")
        r["generate_s"] = docs.get(name, {}).get("generate_s")
        if role == "reference":
            r["verdict"] = "reference"
            continue
        problems: list[str]
        if r["status"] != "ok":
            problems = [f"{r['status']}: {r['error']}"]
        else:
            d = compare(ref, docs[name], tol)
            r["diff"] = d.to_dict()
            r["spec_decode"] = docs[name].get("spec_decode") or {}
            problems = d.problems(tol)
        r["problems"] = problems
        if role == "spread":
            r["verdict"] = "spread" if r["status"] == "ok" else "fail"
        elif expect and role == "check":
            r["verdict"] = "expected-fail" if _matches(expect, r) else "fail"
        else:
            r["verdict"] = "fail" if problems else "pass"
        failed |= r["verdict"] == "fail"
    summary["verdict"] = "fail" if failed else "pass"
    return summary


def _matches(expect: str, record: dict[str, Any]) -> bool:
    kind, _, pattern = expect.partition(":")
    if kind == "crash":
        return record["status"] == "crashed" and bool(re.search(pattern, record["error"] or ""))
    if kind == "mismatch":
        return record["status"] == "ok" and bool(record["problems"])
    raise ValueError(f"--expect: unknown kind {kind!r} (crash:REGEX or mismatch)")


def report(out: Path, summary: dict[str, Any], records: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """``results.json`` (machines) and ``REPORT.md`` (people), rewritten after every case."""
    doc = {"meta": meta, "summary": summary, "cases": records}
    (out / "results.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    lines = [f"# Engine check: {summary.get('verdict', '?')}", ""]
    for k in ("model", "tree", "vllm", "gpus", "started"):
        if meta.get(k):
            lines.append(f"- {k}: `{meta[k]}`")
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
        note = "; ".join(r.get("problems") or []) or r["case"].get("note", "")
        lines.append(f"| {r['case']['name']} | {r['case']['role']} | {r['status']} | {r.get('verdict', '')} | {dl} "
                     f"| {r.get('startup_s') or ''} | {r.get('generate_s') or ''} | {note[:300]} |")
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m overlay.engine.check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, help="checkpoint folder (generated there when missing)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cases", help="comma-separated case names (default: all for --tp, in order)")
    ap.add_argument("--timeout", type=float, default=420, help="seconds per case")
    ap.add_argument("--budget", type=float, default=0, help="stop starting cases after this many seconds (0: none)")
    ap.add_argument("--tree", type=Path, help="a vLLM tree to put first on the children's PYTHONPATH")
    ap.add_argument("--rejudge", action="store_true", help="judge the cases already in --out again (no runs)")
    ap.add_argument("--reuse", type=Path, help="take the reference and spread results of an earlier --out here")
    ap.add_argument("--variant", type=Path, help="a variant tarball (engine.variants): lay it over vllm, use as --tree")
    ap.add_argument("--expect", help="crash:REGEX or mismatch: the checked cases must fail so (seed-bug variants)")
    ns = ap.parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    if ns.rejudge:
        return rejudge(ns.out, ns.expect)
    if ns.variant:
        ns.tree = lay_variant(ns.variant, ns.out / "tree")

    from overlay.engine.checkpoint import TinyGlm5Spec, checkpoint_id, default_cache, generate

    spec = TinyGlm5Spec()
    model = ns.model or default_cache() / checkpoint_id(spec, 0)
    generate(model, spec, 0)
    todo = cases(ns.tp)
    if ns.cases:
        wanted = ns.cases.split(",")
        unknown = sorted(set(wanted) - {c.name for c in todo})
        if unknown:
            print(f"error: unknown case(s) for --tp {ns.tp}: {', '.join(unknown)}", file=sys.stderr)
            return 2
        todo = [c for c in todo if c.name in wanted]
    meta = {"model": str(model), "tree": str(ns.tree or ""), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    records: list[dict[str, Any]] = []
    t_start = time.monotonic()
    summary: dict[str, Any] = {}
    for case in todo:
        elapsed = time.monotonic() - t_start
        if ns.budget and elapsed + min(ns.timeout, _typical(records)) > ns.budget:
            records.append({"case": case.to_dict(), "status": "skipped", "error": "out of budget", "wall_s": 0})
            continue
        reused = _reuse(case, ns.reuse, ns.out) if ns.reuse else None
        records.append(reused or run_one(case, model, ns.out, ns.timeout, ns.tree))
        summary = judge([r for r in records if r["status"] != "skipped"], ns.out, ns.expect)
        report(ns.out, summary, records, meta)
    summary = judge([r for r in records if r["status"] != "skipped"], ns.out, ns.expect)
    report(ns.out, summary, records, meta)
    print(f"[engine-check] verdict: {summary['verdict']} ({ns.out / 'REPORT.md'})", flush=True)
    return {"pass": 0, "fail": 1}.get(summary["verdict"], 2)


def rejudge(out: Path, expect: str | None) -> int:
    """Judge the records of ``out/results.json`` again (another tolerance rule), rewrite the report."""
    doc = json.loads((out / "results.json").read_text())
    keep = ("case", "status", "error", "wall_s", "rc", "reused")
    records = [{k: r[k] for k in keep if k in r} for r in doc["cases"]]
    summary = judge([r for r in records if r["status"] != "skipped"], out, expect)
    report(out, summary, records, doc.get("meta", {}))
    print(f"[engine-check] verdict: {summary['verdict']} ({out / 'REPORT.md'})", flush=True)
    return {"pass": 0, "fail": 1}.get(summary["verdict"], 2)


def _reuse(case: Case, earlier: Path, out: Path) -> dict[str, Any] | None:
    """The record of a reference / spread case from an earlier run (same case), its outputs copied."""
    if case.role not in ("reference", "spread"):
        return None
    try:
        doc = json.loads((earlier / "results.json").read_text())
    except (OSError, ValueError):
        return None
    for rec in doc.get("cases", []):
        if rec["case"] == case.to_dict() and rec["status"] == "ok" and (earlier / f"{case.name}.json").exists():
            if earlier.resolve() != out.resolve():
                (out / f"{case.name}.json").write_bytes((earlier / f"{case.name}.json").read_bytes())
            print(f"[engine-check] {case.name}: reused from {earlier}", flush=True)
            return {"case": case.to_dict(), "status": "ok", "error": "", "wall_s": rec.get("wall_s", 0),
                    "rc": 0, "reused": str(earlier)}
    return None


def _typical(records: list[dict[str, Any]]) -> float:
    walls = [r["wall_s"] for r in records if r.get("status") == "ok"]
    return max(walls) if walls else 0.0


if __name__ == "__main__":
    raise SystemExit(main())
