"""An engine case's projection before the DCP merge reaches the build under test the way that build reads it: a
case says ``on`` / ``off`` (``Case.projection``), and ``run_case`` spells it by the switch of the tree it imports
(0.34.0's series: the engine argument; 0.28.0's: ``VLLM_DCP_PROJECT_BEFORE_MERGE``, set before vLLM is imported);
a build without a switch fails the case in one line naming it. Case files and records written when cases set the
variable read as the projection they asked."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlay.engine import run_case
from overlay.engine.workload import Case, cases
from overlay.releases.engine_cases import holds, record_projection
from overlay.releases.projection import ProjectionError
from tests import factskit

REPO = Path(__file__).resolve().parents[2]
VAR = "VLLM_DCP_PROJECT_BEFORE_MERGE"
FIELD = "dcp_v_up_proj_before_merge"


def _build(tmp_path: Path, projection: str | None, init: str = "") -> Path:
    """A folder holding a synthetic vLLM 0.34.0 tree with the given switch (``vllm/__init__.py``: ``init``)."""
    root = factskit.tree("0.34.0", projection=projection).write(tmp_path / f"tree-{projection}")
    (root / "vllm" / "__init__.py").write_text(init)
    return root


def test_each_build_gets_its_own_spelling(tmp_path: Path) -> None:
    on, off = Case("c-on", dcp=2, projection="on"), Case("c-off", dcp=2, projection="off")
    argument, env = _build(tmp_path, "argument"), _build(tmp_path, "env")
    assert run_case.projection_settings(on, argument) == ({FIELD: "on"}, {})
    assert run_case.projection_settings(off, argument) == ({FIELD: "off"}, {})
    assert run_case.projection_settings(on, env) == ({}, {VAR: "1"})
    assert run_case.projection_settings(off, env) == ({}, {VAR: "0"})
    for tree in (argument, env, _build(tmp_path, None), None):  # a case that leaves it to the build: nothing
        assert run_case.projection_settings(Case("default", dcp=2), tree) == ({}, {})


def test_a_build_without_the_switch_fails_the_case_in_one_line(tmp_path: Path) -> None:
    bare = _build(tmp_path, None)
    with pytest.raises(ProjectionError) as exc:
        run_case.projection_settings(Case("dcp-a2a-direct-proj0-graph", dcp=2, projection="off"), bare)
    assert str(exc.value).startswith(f"case dcp-a2a-direct-proj0-graph: projection off: vllm 0.34.0 at {bare} has "
                                     "no switch for the projection before the DCP merge")
    assert "\n" not in str(exc.value)
    with pytest.raises(ProjectionError, match=r"^case x: projection on: no vllm importable$"):
        run_case.projection_settings(Case("x", projection="on"), None)
    with pytest.raises(ProjectionError, match=r"^case x: projection on: the vllm at .* cannot tell how it switches"):
        run_case.projection_settings(Case("x", projection="on"), tmp_path / "nothing")


def _run_case(tmp_path: Path, tree: Path, case: Case) -> subprocess.CompletedProcess[str]:
    (tmp_path / "case.json").write_text(json.dumps(case.to_dict()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)])}
    env.pop(VAR, None)
    return subprocess.run([sys.executable, "-m", "overlay.engine.run_case", "--case", str(tmp_path / "case.json"),
                           "--model", "/m", "--out", str(tmp_path / "out.json")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_run_case_refuses_before_any_engine_and_sets_the_variable_before_vllm_is_imported(tmp_path: Path) -> None:
    """The child as ``engine-check`` starts it: on a build without a switch it exits 2 with the case's one line
    and never imports vLLM; on a variable-switched one vLLM is imported with the variable already set."""
    said = (f"import os, sys\nsys.stderr.write('vllm imported, ' + repr(os.environ.get('{VAR}')) + '\\n')\n"
            "raise SystemExit(7)\n")
    bare = _build(tmp_path, None, said)
    proc = _run_case(tmp_path, bare, Case("dcp-defaults-proj1-graph-mtp", dcp=2, projection="on"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"run_case: case dcp-defaults-proj1-graph-mtp: projection on: vllm 0.34.0 at {bare} has no switch for the "
        "projection before the DCP merge (neither --dcp-v-up-proj-before-merge nor VLLM_DCP_PROJECT_BEFORE_MERGE): "
        "it cannot be turned on"]
    env_tree = _build(tmp_path, "env", said)
    for value, flag in (("on", "'1'"), ("off", "'0'"), ("", "None")):
        proc = _run_case(tmp_path, env_tree, Case("c", dcp=2, projection=value))
        assert (proc.returncode, proc.stderr.splitlines()[-1]) == (7, f"vllm imported, {flag}"), proc.stderr


def test_no_case_sets_the_variable_and_each_asks_on_or_off() -> None:
    every = [c for facts in (None, factskit.facts("0.34.0"), factskit.facts("0.33.0")) for tp in (1, 2)
             for c in cases(tp, facts)]
    assert not any(VAR in c.env for c in every)
    assert {c.projection for c in every} == {"", "on", "off"}
    assert all(c.projection == "" for c in every if c.dcp == 1)
    by = {c.name: c for c in every}
    assert (by["dcp-a2a-direct-proj1-graph-mtp"].projection, by["dcp-a2a-direct-proj0-graph"].projection) == ("on",
                                                                                                              "off")
    assert by["dcp-defaults-graph-mtp"].projection == ""  # the release's defaults: nothing asked


def test_older_case_files_and_records_read_as_the_projection_they_asked() -> None:
    old = {"name": "dcp-a2a-direct-proj0-graph", "dcp": 2, "backend": "a2a",
           "env": {VAR: "0", "VLLM_USE_DIRECT_DCP_A2A": "1"}}
    case = Case.from_dict(old)
    assert (case.projection, case.env) == ("off", {"VLLM_USE_DIRECT_DCP_A2A": "1"})
    assert case.to_dict()["projection"] == "off" and VAR not in case.to_dict()["env"]
    assert Case.from_dict(json.loads(json.dumps(case.to_dict()))) == case
    assert Case.from_dict({"name": "r", "env": {}}).projection == ""
    assert "projection" not in Case("r").to_dict()  # a case that asks nothing is written as before
    # a record (as engine_records and --coverage's acts read it): the old and the new form meet the same conditions
    for record in (old, case.to_dict()):
        assert holds(record, ("dcp>1", "projection:off")) and not holds(record, ("projection:on",))
        assert holds(record, ("env:VLLM_USE_DIRECT_DCP_A2A=1",))
    assert holds(case, ("projection:off",)) and not holds(Case("r", dcp=2), ("projection:off",))
    with pytest.raises(ProjectionError, match=r"^case 'x': VLLM_DCP_PROJECT_BEFORE_MERGE='on': expected 0"):
        record_projection({"name": "x", "env": {VAR: "on"}})
    with pytest.raises(ProjectionError, match=r"^case 'x': projection 'on' but VLLM_DCP_PROJECT_BEFORE_MERGE='0'$"):
        Case.from_dict({"name": "x", "projection": "on", "env": {VAR: "0"}})
    with pytest.raises(ProjectionError, match=r"^case 'x': projection 'auto': expected on, off or none"):
        Case.from_dict({"name": "x", "projection": "auto"})


def test_the_installed_builds_engine_args_take_what_is_passed() -> None:
    """On the installed build: what run_case passes for on and off is what its EngineArgs and ParallelConfig take
    (the engine would refuse an unknown keyword), or the variable where the build reads that."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    from overlay.releases.source import importable_tree

    fields = {f.name for f in dataclasses.fields(arg_utils.EngineArgs)}
    for value in ("on", "off"):
        kwargs, env = run_case.projection_settings(Case("c", dcp=2, projection=value), importable_tree())
        if FIELD not in fields:
            assert (kwargs, env) == ({}, {VAR: "1" if value == "on" else "0"})
            continue
        assert (kwargs, env) == ({FIELD: value}, {})
        config = pytest.importorskip("vllm.config")
        assert getattr(config.ParallelConfig(**kwargs), FIELD) == value


def test_a_variant_without_the_switch_runs_its_case_on_the_releases_own_merge(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A seed-bug variant's tree without a switch (``stock``) is judged on its seed bug: its case runs there
    without asking the projection (as when cases set a variable the tree ignored), and the run says so; on a tree
    with a switch, and on the installed build, the case keeps what it asks."""
    from overlay.engine import check

    case = Case("dcp-a2a-direct-proj1-graph-mtp", dcp=2, projection="on", acts=("a.patch",))
    for tree in (None, _build(tmp_path, "argument"), _build(tmp_path, "env")):
        assert check.on_tree(case, tree) == case
    bare = _build(tmp_path, None)
    ran = check.on_tree(case, bare)
    assert ran == dataclasses.replace(case, projection="") and ran.acts == case.acts
    assert (f"dcp-a2a-direct-proj1-graph-mtp on {bare}: vllm 0.34.0 at {bare} has no projection switch; the case "
            "runs without asking it on") in capsys.readouterr().out
    assert check.on_tree(Case("ref", dcp=1), bare) == Case("ref", dcp=1)
