"""Issue 25, shared cause (a): the differential check's reference, file or server, goes through one schema.

Items 1 (``--ref-file`` of the wrong shape), 2 (``--ref-url`` replies of the wrong shape) and 8 (a
reference that stops early is the reference's fault): each is a harness failure, exit 2, verdict
``harness`` and report.md written, with one line naming the source and the field, never a
traceback or a regression blamed on the server under test.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from regress_helpers import run_cli
from test_regress_differential import _profile


def _harness(run: Any, *words: str) -> str:
    assert run.code == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert (run.out / "report.md").exists() and run.report["verdict"] == "harness failure"
    assert (run.out / "verdict").read_text() == "harness\n"
    line = next(f["message"] for f in run.findings("harness"))
    for w in words:
        assert w in line, line
    assert not run.findings("regression"), run.findings("regression")
    return line


@pytest.fixture
def recording(standin: Callable[..., Any], tmp_path: Path) -> tuple[dict[str, Any], str]:
    ref = standin("healthy")
    rec = tmp_path / "ref.json"
    run = run_cli(_profile(tmp_path), tmp_path / "rec", "--base-url", ref.url, "--record-differential", str(rec))
    assert run.code == 0, run.stderr
    return json.loads(rec.read_text()), ref.url


def _cut_tokens(doc: dict[str, Any]) -> None:
    req = doc["runs"][0]["requests"][1]
    req["tokens"], req["top"] = req["tokens"][:3], req["top"][:3]


CUTS: dict[str, tuple[Callable[[dict[str, Any]], None], tuple[str, ...]]] = {
    "runs-empty-object": (lambda d: d.update(runs=[{}]), ("runs.0.requests: Field required",)),
    "runs-a-string": (lambda d: d.update(runs="xx"), ("runs:",)),
    "fewer-requests": (lambda d: d["runs"][0]["requests"].pop(), ("runs[0]", "2 requests for the profile's 3")),
    "logprobs-cut": (lambda d: d["runs"][1]["requests"][0]["prompt_logprobs"].pop(),
                     ("runs.1.requests.0", "39 prompt logprobs for a 40-token prompt")),
    "tokens-cut": (_cut_tokens, ("runs[0]: requests[1]: 3 tokens generated for max_tokens 8",)),
    "top-cut": (lambda d: d["runs"][0]["requests"][2]["top"].pop(), ("7 top-logprob rows for 8 tokens",)),
}


@pytest.mark.parametrize("cut", list(CUTS))
def test_ref_file_of_the_wrong_shape_is_a_harness_failure(recording: tuple[dict[str, Any], str],
                                                          tmp_path: Path, cut: str) -> None:
    """Issue 25 item 1: a ``--ref-file`` with the right prompts_sha256 but a broken body (exit 2, report.md)."""
    doc, url = recording
    change, words = CUTS[cut]
    change(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    run = run_cli(_profile(tmp_path), tmp_path / "out", "--base-url", url, "--ref-file", str(bad))
    _harness(run, f"differential: {bad}", *words)


@pytest.mark.parametrize(("fault", "words"), [
    ("no-choices", ("not a completions reply", "choices: List should have at least 1 item")),
    ("short-prompt-logprobs", ("prompt logprobs for a 40-token prompt",)),
    ("top-logprobs-lists", ("choices.0.logprobs.top_logprobs.0", "valid dictionary")),
])
def test_ref_url_replies_of_the_wrong_shape_are_a_harness_failure(standin: Callable[..., Any], tmp_path: Path,
                                                                  fault: str, words: tuple[str, ...]) -> None:
    """Issue 25 item 2: ``--ref-url`` replying ``choices: []``, short ``prompt_logprobs``, lists for top_logprobs."""
    ref, test = standin("healthy", "--reply-fault", fault), standin("healthy")
    run = run_cli(_profile(tmp_path), tmp_path / "out", "--base-url", test.url, "--ref-url", ref.url)
    _harness(run, f"differential: reference {ref.url}", *words)


def test_a_reference_that_stops_early_is_the_references_fault(standin: Callable[..., Any], tmp_path: Path) -> None:
    """Issue 25 item 8: a reference returning 3 tokens for max_tokens 8 is harness, not a regression."""
    ref, test = standin("healthy", "--reply-fault", "short-tokens"), standin("healthy")
    run = run_cli(_profile(tmp_path), tmp_path / "out", "--base-url", test.url, "--ref-url", ref.url)
    _harness(run, f"reference {ref.url}: reference run: requests[0]: 3 tokens generated for max_tokens 8",
             "the reference stopped early")


def test_a_check_that_crashes_is_a_harness_failure_with_its_report(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25 item 1 (its second half): whatever a check raises, the verdict is harness and report.md is written."""
    from overlay.regress import runner
    from overlay.regress.checks import CHECKS
    from overlay.regress.results import RunReport, StepResult

    def boom(ctx: object) -> None:
        raise KeyError("requests")

    check = next(c for c in CHECKS if c.name == "differential")
    monkeypatch.setattr(runner, "function", lambda ref: boom)
    report = RunReport(None, "", attached=True, out_dir=tmp_path, started="")  # type: ignore[arg-type]
    assert runner._run_step(check, runner.StepContext(None, None, tmp_path, print), report) is False  # type: ignore[arg-type]
    step: StepResult = report.steps[-1]
    assert step.status == "error" and step.findings[0].kind == "harness"
    assert step.findings[0].message.startswith("KeyError: 'requests' (at test_reliability_differential.py:")

