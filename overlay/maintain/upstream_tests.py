"""``make upstream-tests``: vLLM's own tests of the modules the series touches, on the patched tree.

The release's ``tests/`` tree comes from its verified sdist (``<cache>/sdists/``), extracted once
into ``<cache>/upstream-tests/<version>-<sdist sha256[:12]>/tests/``. The selection rule: every
``test_*.py`` file there that imports a Python module the series touches (``import vllm.a.b``,
``from vllm.a.b import x``, ``from vllm.a import b``, at any depth of the file), less the modules
and files the release's expected file (``patches/<version>/upstream-tests.toml``) leaves out, each with
its reason. The files run in one pytest process against the installed vLLM with a per-test
timeout; tests needing CUDA skip themselves (vLLM's ``skipif`` / ``current_platform`` checks).

Each failure is then run again on the unpatched base tree (``overlay.maintain.trees.base_tree``, first on
``PYTHONPATH``): one that fails there too is the CPU environment's, not the series' (reported,
not held against the gate). The verdict: a failure listed in the expected file is fine; a listed
test that passes (or no longer exists) is a stale entry; any other failure of the patched tree
alone fails the gate. Exit 0 pass, 1 fail; :class:`UpstreamTestsError` (exit 2) for a broken
harness.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from overlay import textfile
from overlay.build.series import Series
from overlay.errors import OverlayError
from overlay.interrupt import bound_to_parent

EXPECTED_NAME = "upstream-tests.toml"  # in the release's folder, beside its pin and series: the release's own
PLUGIN = "overlay.maintain.upstream_plugin"
RESULTS_ENV = "OVERLAY_UPSTREAM_RESULTS"
# vLLM's tests/conftest.py imports tblib (a test requirement of vLLM's, not of vLLM) only to
# pickle tracebacks across processes; a stand-in keeps that one import from failing every file.
_TBLIB_STANDIN = "class pickling_support:\n    @staticmethod\n    def install(*args, **kwargs):\n        pass\n"


class UpstreamTestsError(OverlayError):
    """The harness could not produce a verdict (bad expected file, pytest crashed, nothing selected)."""

    exit_code = 2


@dataclass(frozen=True)
class Excluded:
    """A touched module or a test file left out of the selection, with why."""

    path: str
    reason: str


@dataclass(frozen=True)
class ExpectedFailure:
    """A deliberate contract change: an upstream test the series makes fail, on purpose."""

    test: str
    patch: str
    reason: str


@dataclass(frozen=True)
class Expectations:
    """``patches/<version>/upstream-tests.toml``: selection exclusions and expected failures."""

    exclude_modules: tuple[Excluded, ...] = ()
    exclude_tests: tuple[Excluded, ...] = ()
    expected: tuple[ExpectedFailure, ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, object], source: str, patch_names: set[str] | None = None) -> Expectations:
        """Validate ``data``; every problem is collected before raising."""
        problems: list[str] = []

        def entries(table: object, where: str, keys: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
            if table is None:
                return []
            if not isinstance(table, list):
                problems.append(f"{where}: must be an array of tables")
                return []
            good: list[tuple[int, dict[str, str]]] = []
            for i, item in enumerate(table):
                if not isinstance(item, dict):
                    problems.append(f"{where}[{i}]: must be a table")
                    continue
                bad = [k for k in keys if not isinstance(item.get(k), str) or not item[k].strip()]
                bad += [f"unknown {k!r}" for k in sorted(set(item) - set(keys))]
                if bad:
                    problems.append(f"{where}[{i}]: " + ", ".join(
                        b if b.startswith("unknown") else f"missing or empty {b!r}" for b in bad))
                    continue
                good.append((i, item))
            return good

        unknown = sorted(set(data) - {"selection", "expected_failure"})
        if unknown:
            problems.append(f"unknown key(s) {', '.join(map(repr, unknown))}")
        selection = data.get("selection", {})
        if not isinstance(selection, dict):
            problems.append("selection: must be a table")
            selection = {}
        unknown = sorted(set(selection) - {"exclude_module", "exclude_test"})
        if unknown:
            problems.append(f"selection: unknown key(s) {', '.join(map(repr, unknown))}")
        mods = entries(selection.get("exclude_module"), "selection.exclude_module", ("path", "reason"))
        tests = entries(selection.get("exclude_test"), "selection.exclude_test", ("path", "reason"))
        expected = entries(data.get("expected_failure"), "expected_failure", ("test", "patch", "reason"))
        seen: set[str] = set()
        for i, e in expected:
            if "::" not in e["test"] or not e["test"].startswith("tests/"):
                problems.append(f"expected_failure[{i}]: test {e['test']!r} is not a node id (tests/...py::name)")
            if e["test"] in seen:
                problems.append(f"expected_failure[{i}]: {e['test']!r} is listed twice")
            seen.add(e["test"])
            if patch_names is not None and e["patch"] not in patch_names:
                problems.append(f"expected_failure[{i}]: patch {e['patch']!r} is not in the series")
        if problems:
            raise UpstreamTestsError(f"{source}: " + "; ".join(problems))
        return cls(
            tuple(Excluded(m["path"], m["reason"]) for _, m in mods),
            tuple(Excluded(t["path"], t["reason"]) for _, t in tests),
            tuple(ExpectedFailure(e["test"], e["patch"], e["reason"]) for _, e in expected),
        )

    @classmethod
    def load(cls, path: Path, patch_names: set[str] | None = None) -> Expectations:
        if not path.exists():  # no exclusions would select vLLM's whole suite (65 files, not 13): stop
            raise UpstreamTestsError(f"{path}: missing: the release's expectations (excluded modules and tests, "
                                     "expected failures); write it, empty tables if none apply")
        try:
            data = tomllib.loads(textfile.decode(path.read_bytes(), str(path), UpstreamTestsError))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise UpstreamTestsError(f"{path}: cannot read: {exc}") from None
        return cls.from_dict(data, str(path), patch_names)


def module_name(path: str) -> str | None:
    """``vllm/a/b.py`` -> ``vllm.a.b`` (a package's ``__init__.py`` -> the package); else None."""
    if not path.startswith("vllm/") or not path.endswith(".py"):
        return None
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def touched_modules(series: Series, exclude: tuple[Excluded, ...] = ()) -> dict[str, tuple[str, ...]]:
    """Dotted module -> the patches touching it, for every Python file of the series not excluded."""
    skip = {e.path for e in exclude}
    out: dict[str, list[str]] = {}
    for patch in series.patches:
        for path in patch.touched:
            mod = module_name(path)
            if mod and path not in skip:
                out.setdefault(mod, []).append(patch.name)
    return {m: tuple(p) for m, p in sorted(out.items())}


def imported_modules(source: str) -> set[str]:
    """Every module a file imports anywhere; ``from a import b`` counts ``a`` and ``a.b``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def select_tests(tests_root: Path, modules: set[str],
                 exclude: tuple[Excluded, ...] = ()) -> dict[str, tuple[str, ...]]:
    """``tests/...py`` (relative to ``tests_root``'s parent) -> the touched modules it imports."""
    skip = {e.path for e in exclude}
    out: dict[str, tuple[str, ...]] = {}
    for path in sorted(tests_root.rglob("test_*.py")):
        rel = path.relative_to(tests_root.parent).as_posix()
        if rel in skip:
            continue
        hits = imported_modules(path.read_text(encoding="utf-8", errors="replace")) & modules
        if hits:
            out[rel] = tuple(sorted(hits))
    return out


def tests_tree(sdist: Path, sdist_sha256: str, version: str, cache: Path) -> Path:
    """The folder holding the release's ``tests/`` (extracted from ``sdist`` on first use)."""
    from overlay.build.sdist import extract_subtree

    root = cache / "upstream-tests" / f"{version}-{sdist_sha256[:12]}"
    if not (root / "tests").is_dir():
        extract_subtree(sdist, "tests/", root / "tests")
    # An empty ini of our own: rootdir is this folder, and no repository's pytest settings apply.
    (root / "pytest.ini").write_text("[pytest]\n")
    shim = root / "_standins" / "tblib"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text(_TBLIB_STANDIN)
    return root


@dataclass
class Outcome:
    """One test node: ``passed``, ``failed`` or ``skipped``; ``message`` is the first line of why."""

    outcome: str
    message: str = ""


def run_pytest(root: Path, files: list[str], *, timeout: int, extra_path: list[Path],
               results: Path, select: list[str] | None = None) -> dict[str, Outcome]:
    """Run ``files`` (or node ids) under ``root`` with ``python -m pytest``; outcome per node id."""
    results = results.resolve()  # pytest runs in ``root``: a relative path would point there
    results.unlink(missing_ok=True)
    env = dict(os.environ, **{RESULTS_ENV: str(results)})
    env.pop("OVERLAY_VLLM_TREE", None)
    # No model hub here (the package registries only): a test that needs a hub model fails at once
    # on both trees instead of waiting on network retries (about a minute a test, seen when
    # gpu_model_runner.py's tests joined the selection: hours for the two runs).
    env.setdefault("HF_HUB_OFFLINE", "1")
    paths = [str(p.resolve()) for p in extra_path]
    repo = str(Path(__file__).resolve().parents[2])  # the folder holding the plugin module, wherever pytest runs
    env["PYTHONPATH"] = os.pathsep.join([*paths, repo, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    standins = str(root / "_standins")
    env["PYTHONPATH"] += os.pathsep + standins  # last: a real tblib wins
    cmd = [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", "-c", "pytest.ini",
           "--rootdir", ".", "--continue-on-collection-errors", f"--timeout={timeout}", "-q", "-rN", *(select or files)]
    proc = subprocess.run(cmd, cwd=root, env=env, check=False, preexec_fn=bound_to_parent())  # none runs on
    if proc.returncode not in (0, 1) or not results.exists():
        raise UpstreamTestsError(f"pytest in {root} exited {proc.returncode} without a test verdict "
                                 "(2 interrupted, 3 internal error, 4 usage, 5 nothing collected)")
    out: dict[str, Outcome] = {}
    for line in results.read_text().splitlines():
        rec = json.loads(line)
        node, when, outcome = rec["nodeid"], rec["when"], rec["outcome"]
        cur = out.setdefault(node, Outcome("passed"))
        if outcome == "failed" and cur.outcome != "failed":
            cur.outcome, cur.message = "failed", (f"{when}: " if when != "call" else "") + rec["message"]
        elif outcome == "skipped" and cur.outcome == "passed":
            cur.outcome, cur.message = "skipped", rec["message"]
    return out


@dataclass
class Report:
    """What ``make upstream-tests`` found; ``verdict`` is ``pass`` or ``fail``."""

    version: str
    modules: dict[str, tuple[str, ...]]
    selected: dict[str, tuple[str, ...]]
    excluded: list[dict[str, str]]
    counts: dict[str, int]
    seconds: float
    expected_failing: list[dict[str, str]] = field(default_factory=list)
    stale: list[dict[str, str]] = field(default_factory=list)
    base_failures: list[dict[str, str]] = field(default_factory=list)
    regressions: list[dict[str, str]] = field(default_factory=list)
    skipped_expected: list[dict[str, str]] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return "fail" if self.stale or self.regressions else "pass"

    def to_dict(self) -> dict[str, object]:
        return {"verdict": self.verdict, **asdict(self)}


def judge(patched: dict[str, Outcome], base: dict[str, Outcome], expected: tuple[ExpectedFailure, ...],
          ) -> tuple[list[dict[str, str]], ...]:
    """Sort the patched tree's outcomes into expected, stale, base-failing, regressions, unjudged."""
    listed = {e.test: e for e in expected}
    exp_failing, stale, on_base, regressions, unjudged = [], [], [], [], []
    for e in expected:
        got = patched.get(e.test)
        row = {"test": e.test, "patch": e.patch, "reason": e.reason}
        if got is None:
            stale.append({**row, "why": "not collected (renamed or removed upstream?)"})
        elif got.outcome == "passed":
            stale.append({**row, "why": "passes now: drop the entry"})
        elif got.outcome == "skipped":
            unjudged.append({**row, "why": f"skipped: {got.message}"})
        else:
            exp_failing.append({**row, "message": got.message})
    for node, got in sorted(patched.items()):
        if got.outcome != "failed" or node in listed:
            continue
        b = base.get(node)
        if b is not None and b.outcome == "failed":
            on_base.append({"test": node, "message": got.message, "base": b.message})
        else:
            regressions.append({"test": node, "message": got.message})
    return exp_failing, stale, on_base, regressions, unjudged


def format_markdown(r: Report) -> str:
    c = r.counts
    lines = [f"# vLLM {r.version} upstream tests on the patched tree: {r.verdict}", "",
             f"{len(r.selected)} file(s), {c.get('total', 0)} test(s): {c.get('passed', 0)} passed, "
             f"{c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped, in {r.seconds:.0f} s.", "",
             "## Touched modules", ""]
    lines += [f"- `{m}` ({', '.join(p)})" for m, p in r.modules.items()]
    lines += ["", "## Selected files", ""]
    lines += [f"- `{f}`: imports {', '.join(f'`{m}`' for m in mods)}" for f, mods in r.selected.items()]
    if r.excluded:
        lines += ["", "## Left out", ""] + [f"- `{e['path']}`: {e['reason']}" for e in r.excluded]
    sections = [
        ("Regressions (fail the gate)", r.regressions, lambda d: f"`{d['test']}`: {d['message']}"),
        ("Stale expected failures (fail the gate)", r.stale,
         lambda d: f"`{d['test']}` ({d['patch']}): {d['why']}"),
        ("Expected failures (deliberate contract changes)", r.expected_failing,
         lambda d: f"`{d['test']}` ({d['patch']}): {d['reason']}"),
        ("Expected failures that were skipped (not judged)", r.skipped_expected,
         lambda d: f"`{d['test']}` ({d['patch']}): {d['why']}"),
        ("Failing on the unpatched base too (CPU environment, not the series)", r.base_failures,
         lambda d: f"`{d['test']}`: {d['message']}"),
    ]
    for title, rows, fmt in sections:
        if rows:
            lines += ["", f"## {title}", ""] + [f"- {fmt(d)}" for d in rows]
    return "\n".join(lines) + "\n"


def run(patches_root: Path, version: str, out: Path, *, timeout: int = 300, cache: Path | None = None,
        expected_file: Path | None = None, sdist: Path | None = None, base: Path | None = None) -> Report:
    """Select, run, judge and write ``out/upstream-tests.md`` and ``.json``."""
    from overlay.build.fetch import cache_dir
    from overlay.build.pins import load_pin
    from overlay.build.sdist import fetch_sdist, pip_url_download_sdist, sdist_fields

    started = time.monotonic()
    cache = cache or cache_dir()
    try:  # every input the gate cannot run without is the harness's failure (exit 2), not the series' (1)
        pin = load_pin(patches_root, version)
        source = str(patches_root / version / "pin.toml")
        _, sdist_sha = sdist_fields(pin, source)
        series = Series.load(patches_root / version)
        expected_file = expected_file or patches_root / version / EXPECTED_NAME
        exp = Expectations.load(expected_file, {p.name for p in series.patches})
        sdist = sdist or fetch_sdist(pin, source, cache=cache, downloader=pip_url_download_sdist)
        root = tests_tree(sdist, sdist_sha, version, cache)
    except UpstreamTestsError:
        raise
    except OverlayError as exc:
        raise UpstreamTestsError(str(exc)) from exc
    modules = touched_modules(series, exp.exclude_modules)
    selected = select_tests(root / "tests", set(modules), exp.exclude_tests)
    if not selected:
        raise UpstreamTestsError(f"no test file of vllm {version} imports a touched module")
    _progress(f"{len(selected)} file(s) import {len(modules)} touched module(s); running on the patched tree")
    out.mkdir(parents=True, exist_ok=True)
    patched = run_pytest(root, list(selected), timeout=timeout, extra_path=[],
                         results=out / "patched.jsonl")
    failing = sorted(n for n, o in patched.items() if o.outcome == "failed")
    base_out: dict[str, Outcome] = {}
    if failing:
        from overlay.maintain.trees import base_tree

        _progress(f"{len(failing)} failure(s); running them on the unpatched base tree")
        base_out = run_pytest(root, [], timeout=timeout, extra_path=[base or base_tree(patches_root, version)],
                              results=out / "base.jsonl", select=failing)
    exp_failing, stale, on_base, regressions, unjudged = judge(patched, base_out, exp.expected)
    counts = {k: sum(o.outcome == k for o in patched.values()) for k in ("passed", "failed", "skipped")}
    counts["total"] = len(patched)
    report = Report(version, modules, selected,
                    [asdict(e) for e in (*exp.exclude_modules, *exp.exclude_tests)], counts,
                    round(time.monotonic() - started, 1), exp_failing, stale, on_base, regressions, unjudged)
    (out / "upstream-tests.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    (out / "upstream-tests.md").write_text(format_markdown(report))
    return report


def _progress(message: str) -> None:
    print(f"[upstream-tests] {message}", file=sys.stderr, flush=True)
