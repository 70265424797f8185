"""The records the tools write carry paths relative to the cache or the repository, never a machine's absolute path.

A rebase report kept in ``patches/<release>/rebase.json`` named ``/root/.cache/vllm-overlay/deps/...``, an
engine-check record the checkpoint's and the site tree's ``/root/...`` and ``/tmp/...``, a regress report
every file of its run by the folder it happened to run in (issue 52, item 5). Each now goes through
:func:`overlay.build.fetch.recorded_path` (or, for a regress run's own files, :func:`overlay.regress.report.in_run`).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from overlay.build.fetch import REPO_ROOT, recorded_path

REPO = Path(__file__).resolve().parent.parent


def test_a_path_under_the_cache_is_recorded_below_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert recorded_path(cache / "deps" / "0.34.0-62340614bfc3", cache) == "<cache>/deps/0.34.0-62340614bfc3"
    assert recorded_path(str(cache / "checkpoints" / "x") + "/", cache) == "<cache>/checkpoints/x"
    assert recorded_path(cache, cache) == "<cache>"


def test_a_path_in_the_repository_is_recorded_relative_to_it(tmp_path: Path) -> None:
    assert recorded_path(REPO / "overlay" / "regress" / "profiles" / "x.yaml", tmp_path) == \
        "overlay/regress/profiles/x.yaml"
    assert REPO_ROOT == REPO


def test_any_other_absolute_path_keeps_only_its_name_and_a_relative_one_stays(tmp_path: Path) -> None:
    assert recorded_path("/tmp/stage/liveness.json", tmp_path / "cache") == "<elsewhere>/liveness.json"
    assert recorded_path("stage/liveness.json", tmp_path) == "stage/liveness.json"
    assert recorded_path("", tmp_path) == ""


def test_the_default_cache_is_the_tools_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(tmp_path / "c"))
    assert recorded_path(tmp_path / "c" / "deps" / "d") == "<cache>/deps/d"


def test_a_rebase_test_run_records_its_environment_below_the_cache() -> None:
    """``TestRun.environment`` (each run of ``rebase.json``) is the dependency folder, as the cache holds it."""
    from overlay.maintain.rebase import testrun

    src = ast.parse(Path(testrun.__file__).read_text())
    calls = [n for n in ast.walk(src) if isinstance(n, ast.keyword) and n.arg == "environment"]
    assert calls and all(isinstance(k.value, ast.Call) and getattr(k.value.func, "id", "") == "recorded_path"
                         for k in calls), "testrun.py: every TestRun(environment=...) goes through recorded_path"


def test_an_engine_check_record_names_no_machine_path() -> None:
    """``meta.model``, ``meta.tree``, ``meta.liveness`` (engine/check.py) and each case's ``liveness.tree``
    (engine/liveness_run.py) are recorded through recorded_path."""
    for module, keys in (("check.py", {"model", "tree", "liveness"}), ("liveness_run.py", {"tree"})):
        tree = ast.parse((REPO / "overlay" / "engine" / module).read_text())
        seen = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values, strict=True):
                    if isinstance(k, ast.Constant) and k.value in keys:
                        call = v.body if isinstance(v, ast.IfExp) else v
                        if isinstance(call, ast.Dict):
                            continue
                        assert isinstance(call, ast.Call) and getattr(call.func, "id", "") == "recorded_path", \
                            f"overlay/engine/{module}: {k.value!r} (line {k.lineno}) is not recorded_path(...)"
                        seen.add(k.value)
        assert seen == keys, (module, seen)


def test_a_regress_report_names_its_run_files_relative_to_its_folder(tmp_path: Path) -> None:
    from overlay.regress.report import in_run
    from overlay.regress.results import write_verdict

    out = tmp_path / "run"
    data = {"results_file": str(out / "gsm8k" / "results" / "r.json"), "log": str(out / "gsm8k" / "lm_eval.log"),
            "nested": [{"result_file": str(out / "latency" / "latency.json")}], "n": 3,
            "profile": str(REPO / "overlay" / "regress" / "profiles" / "p.yaml"), "other": "/srv/x/y.log"}
    assert in_run(data, out) == {"results_file": "gsm8k/results/r.json", "log": "gsm8k/lm_eval.log",
                                 "nested": [{"result_file": "latency/latency.json"}], "n": 3,
                                 "profile": "overlay/regress/profiles/p.yaml", "other": "<elsewhere>/y.log"}
    write_verdict(out, 0, [], out / "report.md")
    assert json.loads((out / "verdict.json").read_text())["report"] == "report.md"
