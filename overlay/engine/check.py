"""The engine check: run the cases of ``engine.workload`` as real vLLM engines, compare, report.

``overlay engine-check --out DIR [--model DIR] [--tp 2] [--cases a,b] [--timeout S]
[--budget S] [--parallel N] [--variants DIR] [--tree DIR] [--expect KIND[:REGEX]]
[--coverage [--liveness FILE]]`` on a GPU machine where the patched vLLM imports (the device:
``scripts/device-run.sh``). Each case runs in its own process group (``engine.run_case``) under
a timeout, with the test-only ``deep_gemm`` stand-in (``tests/engine/standin``) first on
``PYTHONPATH`` and NVLink multicast off. The DCP 1 reference and spread runs come first; the
tolerance is derived from them and every other case must match the reference within it, greedy
tokens included, and must not crash or hang (``engine.verdict``: each case's verdict, the report).

``--parallel N`` runs up to N engines at once on the same GPUs (start-up is mostly one CPU
core compiling: N engines start in about the time of one). Every engine reserves a fixed
``KV_CACHE_BYTES`` instead of profiling free memory (another engine's allocations would be
counted as its own), listens on its own port range, and keeps its torch.compile cache in its
slot's folder (two engines never write one cache entry at once).

``--coverage`` runs every engine under coverage.py and reports, per case and patch, how many of the
patch's added statements ran; a patch a case declares (``Case.acts``) that ran none fails it
(``engine.liveness_run``; ``--liveness FILE``: the lines each patch added, ``engine.liveness_lines``).

``--variants DIR`` (``engine.variants``' output) adds, after the production shape, one job per
seed-bug variant: that variant's case on the variant's tree, expected to fail the way its bug
report says. ``--tree DIR`` / ``--variant TAR`` with ``--expect crash:REGEX`` or ``--expect
mismatch`` instead run every checked case on one such tree. A variant's tree without a switch for the projection
before the DCP merge (``stock``) runs its case without asking it (:func:`on_tree`), on the release's own merge.

Writes ``DIR/results.json`` and ``DIR/REPORT.md`` after every case (a run cut short keeps what
it measured), and each case's log as ``DIR/<case>.log``. Exit 0: every case as expected;
1: a case failed; 2: the reference itself failed (nothing could be compared).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from overlay.engine.env import PORT_BASE, PORT_STRIDE, REPO, SAFE_ENV, STANDIN, error_line, strip_log_prefix
from overlay.engine.inputs import EngineCheckError, check_inputs, lay_variant, load_variants
from overlay.engine.liveness_run import KILL_GRACE_S, SITE, Measure
from overlay.engine.liveness_run import start as start_measure
from overlay.engine.verdict import judge, read_results, record_name, report
from overlay.engine.workload import Case, cases
from overlay.outpaths import check_dir
from overlay.releases.facts import ReleaseFacts, ReleaseFactsError, release_facts
from overlay.releases.projection import ProjectionError, folder_switch
from overlay.releases.source import importable_tree

RUN_CASE = "overlay.engine.run_case"  # the module each job runs (python -m)


@dataclass
class Job:
    """One engine run: a case, on the installed vLLM or on a variant ``tree``, maybe expected to fail."""

    case: Case
    name: str
    tree: Path | None = None
    expect: str | None = None
    variant: str | None = None

    def record(self, **kw: Any) -> dict[str, Any]:
        rec: dict[str, Any] = {"case": self.case.to_dict(), "name": self.name}
        if self.variant:
            rec |= {"variant": self.variant, "expect": self.expect}
        return rec | kw


def on_tree(case: Case, tree: Path | None) -> Case:
    """``case`` as it runs on a seed-bug variant's ``tree`` (laid over the installed build): where that tree has
    no switch for the projection before the DCP merge (``stock``, a series cut before the patch adding it), the
    case leaves the projection to the tree, whose release merges its own way as it did when cases set the
    variable: a variant is judged on its seed bug, not on the projection. Said in the run's output; the record
    holds the case as run. Elsewhere the case keeps its projection (``run_case`` fails it in one line on a build
    that cannot take it)."""
    if tree is None or not case.projection:
        return case
    try:
        switch, build = folder_switch(tree)
    except ProjectionError:
        return case  # run_case says why, in one line
    if switch is not None:
        return case
    print(f"[engine-check] {case.name} on {tree}: {build} has no projection switch; the case runs without "
          f"asking it {case.projection} (the release's own merge)", flush=True)
    return replace(case, projection="")


def child_env(case: Case, tree: Path | None, slot: int = 0, cache: Path | None = None,
              coverage: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(case.env)
    env.update(SAFE_ENV)
    paths = [str(STANDIN), str(REPO)]
    if tree is not None:
        paths.insert(0, str(tree))
        # a variant's source differs from the series': never share compiled graphs with it
        env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    if coverage is not None:  # --coverage: its sitecustomize first, COVERAGE_PROCESS_START (engine.liveness_run)
        paths.insert(0, str(SITE))
        env.update(coverage)
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Start-up: the CUDA-graph memory estimate took 93 s of a cold 268 s start on two H200s
    # (the check's engines reserve a fixed KV cache; memory accounting is not what it checks).
    env.setdefault("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "0")
    # Engines running side by side: their own ports and torch.compile cache per slot.
    # OVERLAY_ENGINE_PORT_BASE: another check beside this one on the same machine (another release's)
    env["VLLM_PORT"] = str(int(os.environ.get("OVERLAY_ENGINE_PORT_BASE") or PORT_BASE) + slot * PORT_STRIDE)
    if cache is not None:
        env["VLLM_CACHE_ROOT"] = str(cache / f"slot-{slot}")
    return env


# A log line after which the engine cannot recover: vLLM does not always exit then (a worker
# that failed during CUDA-graph capture left its engine waiting until the 450 s timeout on two
# H200s). The job is stopped FATAL_GRACE_S after such a line and recorded as crashed.
FATAL = re.compile(r"WorkerProc hit an exception|Engine core initialization failed|EngineDeadError"
                   r"|WorkerProc initialization failed")
FATAL_GRACE_S = 30.0


# vLLM's capture progress bar ("Capturing CUDA graphs (decode, FULL)") and its fallback warning
# ("... not supported with spec-decode for attention backend ...; setting cudagraph_mode=PIECEWISE").
CAPTURE = re.compile(r"Capturing CUDA graphs \((decode|mixed prefill-decode), (\w+)\)")
# Model Runner V2's bar names the mode alone ("Capturing CUDA graphs (FULL)"): under
# FULL_AND_PIECEWISE its FULL graphs are the decode batches' and its PIECEWISE ones the mixed batches'
# (vllm/v1/worker/gpu/cudagraph_utils.py: decode_mode() / mixed_mode()); the drafter's own bars
# ("Capturing decode CUDA graphs (FULL)") do not count.
CAPTURE_V2 = re.compile(r"Capturing CUDA graphs \((FULL|PIECEWISE)\)")
PIECEWISE_FALLBACK = re.compile(r"[^\r\n]*not supported with spec-decode[^\r\n]*setting cudagraph_mode=PIECEWISE")


def log_shows(log: str, wanted: list[str] | tuple[str, ...]) -> list[str]:
    """Those of ``wanted`` (substrings a case's log must show, ``Case.log_lines``) that ``log`` has."""
    return [w for w in wanted if w in log]


def graph_mode(log: str) -> dict[str, Any]:
    """The CUDA graphs an engine's log shows it captured: ``mode`` is "FULL" when decode steps were
    captured in FULL graphs, "PIECEWISE" when only piecewise graphs were, "" when none; with the
    log lines that say so (the first capture line of each kind, the fallback warning)."""
    kinds: dict[str, str] = {}
    for m in CAPTURE.finditer(log):
        kinds.setdefault(f"{m.group(1)}, {m.group(2)}", f"Capturing CUDA graphs ({m.group(1)}, {m.group(2)})")
    for m in CAPTURE_V2.finditer(log):
        kind = "decode" if m.group(1) == "FULL" else "mixed prefill-decode"
        kinds.setdefault(f"{kind}, {m.group(1)}", f"Capturing CUDA graphs ({m.group(1)})")
    fallback = PIECEWISE_FALLBACK.search(log)
    lines = list(kinds.values()) + ([strip_log_prefix(fallback.group(0).strip())] if fallback else [])
    mode = "FULL" if "decode, FULL" in kinds else ("PIECEWISE" if kinds else "")
    return {"mode": mode, "lines": lines}


@dataclass
class _Running:
    job: Job
    proc: subprocess.Popen
    log: IO[str]
    slot: int
    t0: float
    deadline: float
    log_path: Path | None = None
    seen: int = 0  # bytes of the log already scanned for FATAL
    fatal_at: float | None = None

    def check_fatal(self, grace: float) -> bool:
        """True once a FATAL line has been in the log for ``grace`` seconds without the process exiting."""
        if self.fatal_at is None and self.log_path is not None:
            with self.log_path.open("rb") as f:
                f.seek(max(0, self.seen - 200))  # a line may straddle two reads
                chunk = f.read().decode(errors="replace")
                self.seen = f.tell()
            if FATAL.search(chunk):
                self.fatal_at = time.monotonic()
        return self.fatal_at is not None and time.monotonic() - self.fatal_at > grace


def _start(job: Job, model: Path, out: Path, timeout: float, slot: int, measure: Measure | None = None) -> _Running:
    case_file = out / f"{job.name}.case.json"
    case_file.write_text(json.dumps(job.case.to_dict()))
    result_file = out / f"{job.name}.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", RUN_CASE, "--case", str(case_file), "--model", str(model),
           "--out", str(result_file)]
    print(f"[engine-check] {job.name}: starting in slot {slot} (timeout {timeout:.0f} s)", flush=True)
    log = (out / f"{job.name}.log").open("w")
    env = child_env(job.case, job.tree, slot, out.parent / f"{out.name}-cache",
                    measure.env(job.name) if measure else None)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    now = time.monotonic()
    return _Running(job, proc, log, slot, now, now + timeout, log_path=out / f"{job.name}.log")


def _finish(run: _Running, out: Path, timeout: float, measure: Measure | None = None) -> dict[str, Any]:
    rc = run.proc.poll()
    _kill_group(run.proc, KILL_GRACE_S if measure else 0)  # the engine's workers too, finished or timed out
    run.log.close()
    wall = round(time.monotonic() - run.t0, 1)
    text = (out / f"{run.job.name}.log").read_text(errors="replace")
    if rc is None and run.fatal_at is not None:
        status, why = "crashed", f"{error_line(text)} (stopped {FATAL_GRACE_S:.0f} s after the engine failed)"
    elif rc is None and run.deadline < run.t0 + timeout:  # stopped by the run's budget, not its own timeout
        status, why = "skipped", f"cut at the budget after {wall} s (inconclusive)"
    elif rc is None:
        status, why = "timeout", f"no result within {timeout:.0f} s; last line: {error_line(text)}"
    elif rc != 0 or not (out / f"{run.job.name}.json").exists():
        status, why = "crashed", error_line(text)
    else:
        status, why = "ok", ""
    print(f"[engine-check] {run.job.name}: {status} in {wall} s{': ' + why if why else ''}", flush=True)
    wanted = run.job.case.log_lines
    record = run.job.record(status=status, error=why, wall_s=wall, rc=rc, graphs=graph_mode(text),
                            **({"log_lines": log_shows(text, wanted)} if wanted else {}))
    if measure is not None:
        measure.finish(run.job.name, run.job.case.acts, run.job.tree is not None, record)
    return record


def run_jobs(jobs: list[Job], model: Path, out: Path, *, timeout: float, parallel: int = 1, budget: float = 0,
             reuse: Path | None = None, on_change: Callable[[list[dict[str, Any]]], None] | None = None,
             poll_s: float = 1.0, measure: Measure | None = None) -> list[dict[str, Any]]:
    """Run ``jobs`` at most ``parallel`` at a time, started in order; return their records in job order.

    With a ``budget`` (seconds), the run ends within it: a job is not started ("out of budget")
    when it could not end in time, judged by the slowest job so far (capped at the timeout), and
    a job still running at the budget is stopped and recorded as skipped (inconclusive). ``on_change`` gets the records
    (in job order, unfinished ones left out) whenever a job ends. ``measure`` (``--coverage``) runs each
    job under coverage.py and records its patch liveness.
    """
    done: dict[str, dict[str, Any]] = {}
    pending = list(jobs)
    running: list[_Running] = []
    free = list(range(max(1, parallel)))
    t_start = time.monotonic()

    def changed() -> None:
        if on_change is not None:
            on_change([done[j.name] for j in jobs if j.name in done])

    while pending or running:
        while pending and free:
            job = pending.pop(0)
            reused = _reuse(job, reuse, out, model) if reuse else None
            if reused:
                done[job.name] = reused
                changed()
                continue
            now = time.monotonic()
            typical = max([_typical(list(done.values()))] + [now - r.t0 for r in running])
            if budget and now - t_start + min(timeout, typical) > budget:
                done[job.name] = job.record(status="skipped", error="out of budget", wall_s=0)
                continue
            run = _start(job, model, out, timeout, free.pop(0), measure)
            if budget:  # the whole run ends within its budget: a late job is cut there
                run.deadline = min(run.deadline, t_start + budget)
            running.append(run)
        for run in list(running):
            if (run.proc.poll() is not None or time.monotonic() > run.deadline
                    or run.check_fatal(FATAL_GRACE_S)):
                running.remove(run)
                free.append(run.slot)
                free.sort()
                done[run.job.name] = _finish(run, out, timeout, measure)
                changed()
        if running:
            time.sleep(poll_s)
    return [done[j.name] for j in jobs]


def variant_jobs(variants: Path, tp: int, out: Path, facts: ReleaseFacts | None = None) -> list[Job]:
    """One job per seed-bug variant of ``variants/variants.json`` and case it names (``jobs``: several)
    that this machine can show, among the cases of the build whose release ``facts`` describe."""
    manifest = load_variants(variants)
    by_name = {c.name: c for c in cases(tp, facts)}
    jobs: list[Job] = []
    for variant, v in manifest["variants"].items():
        for shown in v.get("jobs") or [v]:
            if not shown.get("case"):
                print(f"[engine-check] {variant}: not shown here ({shown['symptom']})", flush=True)
                continue
            if shown["case"] not in by_name and tp < 2 and shown["case"] in {c.name for c in cases(2, facts)}:
                print(f"[engine-check] {variant}: not shown at --tp {tp} ({shown['case']} needs DCP 2)", flush=True)
                continue
            if shown["case"] not in by_name:
                raise EngineCheckError(f"{variants / 'variants.json'}: {variant}: no case {shown['case']!r} "
                                       f"for --tp {tp}")
            tree = lay_variant(variants / f"{variant}.tar.gz", out / "trees" / variant)
            jobs.append(Job(on_tree(by_name[shown["case"]], tree), f"{variant}--{shown['case']}", tree=tree,
                            expect=shown["expect"], variant=variant))
    return jobs


def _kill_group(proc: subprocess.Popen, grace: float = 0) -> None:
    """SIGKILL the job's process group; with ``grace``, SIGTERM first and up to ``grace`` seconds for it to
    end (coverage.py saves its data on SIGTERM)."""
    deadline = time.monotonic() + grace
    try:
        if grace > 0:
            os.killpg(proc.pid, signal.SIGTERM)
            while time.monotonic() < deadline:
                proc.poll()  # the leader, reaped: a zombie would count as the group's
                os.killpg(proc.pid, 0)
                time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def release_under_test(tree: Path | None = None) -> str:
    """The vLLM release the engines import, ``x.y.z``: ``tree``'s ``vllm/_version.py``, else the
    installed distribution's version; "" when neither says."""
    if tree is not None:
        try:
            text = (tree / "vllm" / "_version.py").read_text(encoding="utf-8")
        except OSError:
            text = ""
        found = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text, re.M)
        if found:
            return found[1].split("+")[0]
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("vllm").split("+")[0]
    except (ImportError, PackageNotFoundError):
        return ""


def series_under_test(tree: Path | None = None) -> list[dict[str, str]]:
    """The patches the build the engines import carries (its ``vllm/_overlay.json``: name and sha256, the
    record of which version of each patch the run judged); [] for a vLLM without one."""
    where = tree or importable_tree()
    try:
        doc = json.loads((where / "vllm" / "_overlay.json").read_text(encoding="utf-8")) if where else {}
    except (OSError, ValueError):
        return []
    return [{"name": str(p.get("name")), "sha256": str(p.get("sha256"))} for p in doc.get("patches") or []
            if isinstance(p, dict)]


def facts_under_test(tree: Path | None = None) -> ReleaseFacts:
    """The release facts of the vLLM the engines import (``tree``, else the importable one), which pick
    the cases; a release they cannot describe is refused in one line naming what is missing."""
    where = tree or importable_tree()
    if where is None:
        raise EngineCheckError("engine-check: no vllm to check (none importable, no --tree)")
    try:
        return release_facts(where)
    except ReleaseFactsError as exc:
        raise EngineCheckError(f"engine-check: {exc}") from None


def torch_under_test(version: Callable[[str], str] | None = None,
                     requires: Callable[[str], list[str] | None] | None = None) -> str:
    """The torch the engines import and, when it differs, the one the installed vLLM pins:
    ``2.11.0 (vllm pins 2.14.0)``; "" when torch is not installed. Read from the distributions'
    metadata (no torch import)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import requires as dist_requires
    from importlib.metadata import version as dist_version

    version, requires = version or dist_version, requires or dist_requires
    try:
        have = version("torch").split("+")[0]
    except PackageNotFoundError:
        return ""
    try:
        lines = requires("vllm") or []
    except PackageNotFoundError:
        lines = []
    pins = [m[1] for ln in lines if (m := re.match(r"torch\s*==\s*([\w.]+)\s*$", ln))]
    return f"{have} (vllm pins {pins[0]})" if pins and pins[0] != have else have


def gpus_under_test(query: Callable[[list[str]], str] | None = None) -> str:
    """The GPUs the engines see, for the record: ``1 x NVIDIA H100 80GB HBM3`` (``nvidia-smi``'s names of
    the devices ``CUDA_VISIBLE_DEVICES`` leaves, counted per name); ``CUDA_VISIBLE_DEVICES`` itself (or "")
    where ``nvidia-smi`` cannot say."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")

    def smi(args: list[str]) -> str:
        return subprocess.run(args, capture_output=True, text=True, check=True, timeout=30).stdout

    query = query or smi
    args = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"] + (["-i", visible] if visible else [])
    try:
        names = [line.strip() for line in query(args).splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return visible
    return ", ".join(f"{n} x {name}" for name, n in Counter(names).items()) or visible


@dataclass
class CheckOptions:
    """What a person chose for one engine check (``overlay engine-check``'s options, by name)."""

    out: Path
    model: Path | None = None
    tp: int = 2
    cases: str | None = None
    timeout: float = 420
    budget: float = 0
    parallel: int = 1
    tree: Path | None = None
    rejudge: bool = False
    reuse: Path | None = None
    variant: Path | None = None
    variants: Path | None = None
    expect: str | None = None
    release: str | None = None  # the release the engines must import (--vllm); None: whichever is installed
    coverage: bool = False  # --coverage: patch liveness per case (engine.liveness_run)
    liveness: Path | None = None  # --liveness: the lines file (None: $OVERLAY_LIVENESS)


def run_check(ns: CheckOptions) -> int:
    """Every case (or ``ns.cases``) on the engine, judged against DCP 1; 0 pass, 1 fail, 2 not judged."""
    check_dir(ns.out, "--out")
    check_inputs(ns.variant, ns.variants)
    ns.out.mkdir(parents=True, exist_ok=True)
    if ns.rejudge:
        return rejudge(ns.out, ns.expect)
    if ns.variant:
        ns.tree = lay_variant(ns.variant, ns.out / "tree")

    release = release_under_test(ns.tree)
    if ns.release and release != ns.release:
        where = f"--tree {ns.tree}" if ns.tree else "installed"
        raise EngineCheckError(f"engine-check --vllm {ns.release}: the engines would import vllm {release or '(none)'} "
                               f"({where}); install or stage the {ns.release} build first")

    facts = facts_under_test(ns.tree)
    todo = cases(ns.tp, facts)
    if ns.cases:
        wanted = ns.cases.split(",")
        unknown = sorted(set(wanted) - {c.name for c in todo})
        if unknown:
            raise EngineCheckError(f"unknown case(s) for --tp {ns.tp}: {', '.join(unknown)}")
        todo = [c for c in todo if c.name in wanted]
    # --tree applies to the checked cases: references and spread runs stay on the installed series
    jobs = [Job(on_tree(c, ns.tree) if c.role == "check" else c, c.name, tree=ns.tree if c.role == "check" else None)
            for c in todo]
    if ns.variants:
        # after the references, the production shape and the first spread run: the variants
        jobs[4:4] = variant_jobs(ns.variants, ns.tp, ns.out, facts)
    measure = start_measure(ns.liveness, ns.out, [(j.name, a) for j in jobs for a in j.case.acts]) \
        if ns.coverage else None
    from overlay.build.fetch import recorded_path
    from overlay.engine.checkpoint import TinyGlm5Spec, checkpoint_id, default_cache, generate

    spec = TinyGlm5Spec()
    model = ns.model or default_cache() / checkpoint_id(spec, 0)
    generate(model, spec, 0)
    meta = {"model": recorded_path(model), "tree": recorded_path(ns.tree or ""), "vllm": release,
            "release_facts": facts.to_dict(),
            "series": series_under_test(ns.tree), "torch": torch_under_test(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "gpus": gpus_under_test(), "parallel": ns.parallel,
            **({"liveness": recorded_path(measure.lines.path)} if measure else {})}
    t0 = time.monotonic()

    def progress(records: list[dict[str, Any]]) -> None:
        live = [r for r in records if r["status"] != "skipped"]
        report(ns.out, judge(live, ns.out, ns.expect), records, meta | {"wall_s": round(time.monotonic() - t0)})

    records = run_jobs(jobs, model, ns.out, timeout=ns.timeout, parallel=ns.parallel, budget=ns.budget,
                       reuse=ns.reuse, on_change=progress, measure=measure)
    summary = judge([r for r in records if r["status"] != "skipped"], ns.out, ns.expect)
    report(ns.out, summary, records, meta | {"wall_s": round(time.monotonic() - t0)})
    print(f"[engine-check] verdict: {summary['verdict']} ({ns.out / 'REPORT.md'})", flush=True)
    return {"pass": 0, "fail": 1}.get(summary["verdict"], 2)


def rejudge(out: Path, expect: str | None) -> int:
    """Judge the records of ``out/results.json`` again (another tolerance rule), rewrite the report."""
    doc = read_results(out / "results.json", EngineCheckError)
    keep = ("case", "name", "variant", "expect", "status", "error", "wall_s", "rc", "reused", "graphs", "liveness")
    records = [{k: r[k] for k in keep if k in r} for r in doc["cases"]]
    for r in records:  # the graphs and lines its log shows, read again (the rule may have changed since)
        log = out / f"{record_name(r)}.log"
        if log.is_file():
            text = log.read_text(errors="replace")
            r["graphs"] = graph_mode(text)
            if r["case"].get("log_lines"):
                r["log_lines"] = log_shows(text, r["case"]["log_lines"])
    summary = judge([r for r in records if r["status"] != "skipped"], out, expect)
    report(out, summary, records, doc.get("meta", {}))
    print(f"[engine-check] verdict: {summary['verdict']} ({out / 'REPORT.md'})", flush=True)
    return {"pass": 0, "fail": 1}.get(summary["verdict"], 2)


def _reuse(job: Job, earlier: Path, out: Path, model: Path) -> dict[str, Any] | None:
    """The record of a reference / spread case of an earlier run (same case, same model), outputs copied."""
    if job.case.role not in ("reference", "spread") or job.tree is not None:
        return None
    try:
        doc = read_results(earlier / "results.json", EngineCheckError)
    except EngineCheckError as exc:
        print(f"[engine-check] {job.name}: not reused: {exc}", flush=True)
        return None
    if doc.get("meta", {}).get("model") != str(model):
        print(f"[engine-check] {job.name}: not reused: {earlier} ran another checkpoint", flush=True)
        return None
    for rec in doc.get("cases", []):
        saved = earlier / f"{record_name(rec)}.json"
        if rec["case"] == job.case.to_dict() and rec["status"] == "ok" and saved.exists():
            if earlier.resolve() != out.resolve():
                (out / f"{job.name}.json").write_bytes(saved.read_bytes())
            print(f"[engine-check] {job.name}: reused from {earlier}", flush=True)
            return job.record(status="ok", error="", wall_s=rec.get("wall_s", 0), rc=0, reused=str(earlier))
    return None


def _typical(records: list[dict[str, Any]]) -> float:
    walls = [r["wall_s"] for r in records if r.get("status") != "skipped" and not r.get("reused")]
    return max(walls) if walls else 0.0
