"""REBASE.md says whether the release's build has run in an engine (issue 34 item 5), read from the records
where the guides put them (issue 41 item 6: ``docs/records/engine/``).

A rebase proves that the patches apply and that their CPU tests judge them on the release's code;
it does not prove that the build starts, serves and decodes right. The report a rebase writes ends
with "Proven in an engine": never, or the engine-check runs of that build kept under
``docs/records/engine/`` (results whose ``meta.vllm`` is the release: where, when, DCP sizes, which cases).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overlay.build.pins import carried_releases
from overlay.maintain.engine_records import RECORDS, engine_runs
from overlay.maintain.rebase.report import proven_in_an_engine, report_markdown
from overlay.maintain.rebase.state import State

REPO = Path(__file__).resolve().parent.parent


def _state(root: Path) -> State:
    patches = root / "patches"
    patches.mkdir(parents=True, exist_ok=True)
    return State(from_version="0.28.0", to_version="0.33.0", pin={"wheel": "vllm-0.33.0.whl", "sha256": "ab" * 32},
                 patches_root=str(patches), tests_dir=str(root / "tests"), names=[], old_commits=[])


def _run(root: Path, where: str, vllm: str, started: str, verdict: str = "pass") -> None:
    path = root / RECORDS / where
    path = path if path.suffix == ".json" else path / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": {"vllm": vllm, "started": started, "gpus": "0,1"}, "summary": {"verdict": verdict},
           "cases": [{"name": "ref-dcp1", "verdict": "reference", "case": {"name": "ref-dcp1", "dcp": 1}},
                     {"name": "dcp-defaults-graph-mtp", "verdict": verdict,
                      "case": {"name": "dcp-defaults-graph-mtp", "dcp": 2}}]}
    path.write_text(json.dumps(doc))


def test_a_fresh_rebase_says_its_build_never_ran_in_an_engine(tmp_path: Path) -> None:
    text = report_markdown(_state(tmp_path), [])
    section = text[text.index("## Proven in an engine"):]
    assert "Never: no engine has started the vLLM 0.33.0 build" in section
    assert "no engine-check record under `docs/records/engine/` names it" in section
    assert "make build VLLM=0.33.0" in section


def test_the_runs_of_that_build_are_listed_with_where_when_dcp_and_cases(tmp_path: Path) -> None:
    _run(tmp_path, "2xh200-2026-12-05", "0.33.0+ovl1a2b3c4d5e", "2026-12-05T10:00:00")
    _run(tmp_path, "1xh200-2026-12-04/results-0.33.0.json", "0.33.0", "2026-12-04T09:00:00", verdict="fail")
    _run(tmp_path, "1xh200-2026-12-04/results-0.28.0.json", "0.28.0", "2026-12-04T08:00:00")  # another release
    _run(tmp_path, "2xh200-2026-11-30", "0.28.0+ovlc997cfb9f8 (7 patches)", "2026-11-30T08:00:00")
    (tmp_path / RECORDS / "broken").mkdir()
    (tmp_path / RECORDS / "broken" / "results.json").write_text("{not json")
    (tmp_path / "docs" / "engine" / "old").mkdir(parents=True)  # the guide's folder holds no records
    (tmp_path / "docs" / "engine" / "old" / "results.json").write_text((tmp_path / RECORDS / "2xh200-2026-12-05" /
                                                                         "results.json").read_text())
    runs = engine_runs(tmp_path / RECORDS, "0.33.0")
    assert [r.where for r in runs] == ["1xh200-2026-12-04/results-0.33.0.json", "2xh200-2026-12-05"]  # oldest first
    assert [r.where for r in engine_runs(tmp_path / RECORDS, "0.28.0")] == [
        "2xh200-2026-11-30", "1xh200-2026-12-04/results-0.28.0.json"]
    text = report_markdown(_state(tmp_path), [])
    section = text[text.index("## Proven in an engine"):]
    assert "Never" not in section
    assert "2 engine-check run(s) of the vLLM 0.33.0 build (`docs/records/engine/`" in section
    assert ("- `2xh200-2026-12-05` (started 2026-12-05T10:00:00, GPUs `0,1`; DCP 1, 2): pass; `ref-dcp1` reference, "
            "`dcp-defaults-graph-mtp` pass") in section
    assert ("- `1xh200-2026-12-04/results-0.33.0.json` (started 2026-12-04T09:00:00, GPUs `0,1`; DCP 1, 2): "
            "fail;") in section
    assert "2xh200-2026-11-30" not in section and "old" not in section


@pytest.mark.parametrize("release", [r for r in carried_releases(REPO / "patches")
                                     if (REPO / "patches" / r / "REBASE.md").is_file()])
def test_the_shipped_reports_name_only_runs_the_records_hold(release: str) -> None:
    """A rebased release's REBASE.md carries the section (a snapshot of when it was written: ``make status``
    says what is proven now), and every run it names is a record of that build under docs/records/engine/."""
    text = (REPO / "patches" / release / "REBASE.md").read_text()
    section = text[text.index("## Proven in an engine"):].split("\n\n", 2)[1]
    named = [line.split("`")[1] for line in section.splitlines() if line.startswith("- `")]
    held = {r.where for r in engine_runs(REPO / RECORDS, release)}
    assert set(named) <= held, f"REBASE.md names runs the records do not hold: {set(named) - held}"
    assert proven_in_an_engine(release, [])[0] == "## Proven in an engine"


def test_the_report_says_what_changed_in_the_release_facts(tmp_path: Path) -> None:
    """Issue 41 item 3: REBASE.md's "Release facts" sets the old base's facts beside the target's, each
    change in bold (here 0.33.0's shape against 0.34.0's: Model Runner V1 gone, a second direct path)."""
    from tests import factskit

    state = _state(tmp_path)
    state.facts = {"from": factskit.facts("0.33.0").to_dict(), "to": factskit.facts("0.34.0").to_dict()}
    text = report_markdown(state, [])
    section = text[text.index("## Release facts"):text.index("## Reasoning")]
    assert "| fact | 0.33.0 | 0.34.0 |" in section
    assert "| default model runner | V2 (V1 by VLLM_USE_V2_MODEL_RUNNER=0) | **V2 (V1 removed)** |" in section
    assert ("| GLM-5's model class | vllm.models.deepseek_v32.nvidia.model.DeepseekV32ForCausalLM | "
            "vllm.models.deepseek_v32.nvidia.model.DeepseekV32ForCausalLM |") in section
    assert "dsa.dcp_topk_direct**" in section
    assert "## Release facts" not in report_markdown(_state(tmp_path), [])  # a run without facts: none


def test_a_rebase_onto_a_release_the_facts_cannot_describe_is_refused(tmp_path: Path) -> None:
    from overlay.maintain.rebase.release import release_facts_of
    from overlay.maintain.rebase.state import RebaseError
    from tests.wheelkit import make_wheel

    wheel = make_wheel(tmp_path, {"vllm/__init__.py": b""}, version="0.35.0")
    with pytest.raises(RebaseError) as err:
        release_facts_of(wheel)
    assert str(err.value).startswith(f"rebase: {wheel}: vllm 0.35.0: the release facts cannot describe it: GLM-5's "
                                     "path: vllm/model_executor/models/registry.py: not in the tree;")
