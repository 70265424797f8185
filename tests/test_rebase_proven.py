"""REBASE.md says whether the release's build has run in an engine (issue 34 item 5).

A rebase proves that the patches apply and that their CPU tests judge them on the release's code;
it does not prove that the build starts, serves and decodes right. The report a rebase writes ends
with "Proven in an engine": never, or the engine-check runs of that build kept under
``docs/engine/`` (``results.json`` whose ``meta.vllm`` is the release: where, when, which cases).
"""

from __future__ import annotations

import json
from pathlib import Path

from overlay.maintain.rebase.report import engine_runs, proven_in_an_engine, report_markdown
from overlay.maintain.rebase.state import State

REPO = Path(__file__).resolve().parent.parent


def _state(root: Path) -> State:
    patches = root / "patches"
    patches.mkdir(parents=True, exist_ok=True)
    return State(from_version="0.28.0", to_version="0.33.0", pin={"wheel": "vllm-0.33.0.whl", "sha256": "ab" * 32},
                 patches_root=str(patches), tests_dir=str(root / "tests"), names=[], old_commits=[])


def _run(root: Path, folder: str, vllm: str, started: str, verdict: str = "pass") -> None:
    run = root / "docs" / "engine" / folder
    run.mkdir(parents=True)
    doc = {"meta": {"vllm": vllm, "started": started, "gpus": "0,1"}, "summary": {"verdict": verdict},
           "cases": [{"name": "ref-dcp1", "verdict": "reference"},
                     {"name": "dcp-defaults-graph-mtp", "verdict": verdict}]}
    (run / "results.json").write_text(json.dumps(doc))


def test_a_fresh_rebase_says_its_build_never_ran_in_an_engine(tmp_path: Path) -> None:
    text = report_markdown(_state(tmp_path), [])
    section = text[text.index("## Proven in an engine"):]
    assert "Never: no engine has started the vLLM 0.33.0 build" in section
    assert "make build VLLM=0.33.0" in section


def test_the_runs_of_that_build_are_listed_with_where_when_and_cases(tmp_path: Path) -> None:
    _run(tmp_path, "2xh200-2026-12-05", "0.33.0+ovl1a2b3c4d5e", "2026-12-05T10:00:00")
    _run(tmp_path, "1xh200-2026-12-04", "0.33.0", "2026-12-04T09:00:00", verdict="fail")
    _run(tmp_path, "2xh200-2026-11-30", "0.28.0+ovlc997cfb9f8", "2026-11-30T08:00:00")  # another release
    (tmp_path / "docs" / "engine" / "broken").mkdir()
    (tmp_path / "docs" / "engine" / "broken" / "results.json").write_text("{not json")
    runs = engine_runs(tmp_path / "docs" / "engine", "0.33.0")
    assert [r["where"] for r in runs] == ["1xh200-2026-12-04", "2xh200-2026-12-05"]  # oldest first
    text = report_markdown(_state(tmp_path), [])
    section = text[text.index("## Proven in an engine"):]
    assert "Never" not in section
    assert "2 engine-check run(s) of the vLLM 0.33.0 build" in section
    assert ("- `2xh200-2026-12-05` (started 2026-12-05T10:00:00, GPUs `0,1`): pass; `ref-dcp1` reference, "
            "`dcp-defaults-graph-mtp` pass") in section
    assert "- `1xh200-2026-12-04` (started 2026-12-04T09:00:00, GPUs `0,1`): fail;" in section
    assert "2xh200-2026-11-30" not in section


def test_the_shipped_0_33_0_report_says_what_the_runs_say() -> None:
    """patches/0.33.0/REBASE.md carries the section, and it agrees with the runs kept in docs/engine/."""
    text = (REPO / "patches" / "0.33.0" / "REBASE.md").read_text()
    assert "## Proven in an engine" in text
    section = text[text.index("## Proven in an engine"):]
    runs = engine_runs(REPO / "docs" / "engine", "0.33.0")
    if not runs:
        assert section.splitlines()[2].startswith("Never: no engine has started the vLLM 0.33.0 build")
    for run in runs:
        assert f"`{run['where']}`" in section, f"{run['where']} ran the 0.33.0 build; REBASE.md does not say so"
    assert proven_in_an_engine("0.33.0", runs)[0] == "## Proven in an engine"
