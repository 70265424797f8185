"""The prompt sweep as code (issue 41 item 5): TP2 x DCP2 over prompts of 128 to 2,048 tokens, each
against its DCP 1 run, with the release's GLM-5 defaults (on 0.34.0 the direct top-k exchange, which the
engine's log must show it built) and with our profiles' settings; CPU-tested with the run_case stand-in
(``tests/engine/fake_run_case.py``), ready for two H200s.

Upstream #54300: after a release bump, prompts over about 128 tokens came back as random tokens under DCP
while short ones were right; the main workload's prompts (8 to 9,000 tokens) step over that edge once.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from overlay.engine import check, verdict
from overlay.engine.workload import DIRECT_TOPK_LOG, PROFILE_SETTINGS, SWEEP_PROMPT_LENS, Case, cases, sweep_cases
from tests import factskit

LATEST = factskit.facts("0.34.0")
SWEEP = ["ref-dcp1-mtp-sweep", "dcp-defaults-graph-mtp-sweep", "dcp-a2a-direct-proj1-graph-mtp-sweep",
         "dcp-agrs-proj1-graph-mtp-sweep"]


def test_the_sweep_spans_128_to_2048_tokens_around_the_edge() -> None:
    assert min(SWEEP_PROMPT_LENS) == 128 and max(SWEEP_PROMPT_LENS) == 2048
    assert {128, 129} <= set(SWEEP_PROMPT_LENS) and len(set(SWEEP_PROMPT_LENS)) == len(SWEEP_PROMPT_LENS)


def test_0_34_0_runs_the_sweep_with_its_defaults_and_our_profiles_against_dcp1() -> None:
    by = {c.name: c for c in cases(2, LATEST)}
    assert [n for n in by if n.endswith("-sweep")] == SWEEP
    ref = by["ref-dcp1-mtp-sweep"]
    assert (ref.role, ref.dcp, ref.mtp, ref.graphs) == ("reference", 1, True, "FULL")
    for name in SWEEP[1:]:
        c = by[name]
        assert (c.tp, c.dcp, c.mtp, c.graphs, c.compare_to) == (2, 2, True, "FULL", "ref-dcp1-mtp-sweep"), name
        assert c.prompt_lens == SWEEP_PROMPT_LENS and c.release == "0.34.0"
    defaults = by["dcp-defaults-graph-mtp-sweep"]
    assert defaults.backend == "" and not defaults.env  # nothing set: the release decides
    assert defaults.resolves == {"dcp_comm_backend": LATEST.dcp_comm_backend, "dcp_q_replicate": LATEST.dcp_q_replicate}
    a2a, agrs = PROFILE_SETTINGS["tiny-glm5-tp2-dcp2-mtp5"], PROFILE_SETTINGS["tiny-glm5-tp2-dcp2-agrs-mtp5"]
    assert (by[SWEEP[2]].backend, by[SWEEP[2]].env) == (a2a["backend"], a2a["env"])
    assert (by[SWEEP[3]].backend, by[SWEEP[3]].env) == (agrs["backend"], agrs["env"])
    # the direct top-k exchange: on by default with a2a on 0.34.0, so both a2a cases must have built it
    assert defaults.log_lines == by[SWEEP[2]].log_lines == (DIRECT_TOPK_LOG,) and by[SWEEP[3]].log_lines == ()
    kw = defaults.engine_kwargs("/m")
    assert kw["max_model_len"] == 2048 + 64 + 128 and "dcp_comm_backend" not in kw
    assert Case.from_dict(defaults.to_dict()) == defaults


def test_the_sweep_follows_the_facts() -> None:
    """No top-k exchange to show where the release has none (0.33.0) or turns it off by default; no
    defaults case where the defaults are fixed (0.28.0); nothing on one GPU."""
    older = {c.name: c for c in sweep_cases(factskit.facts("0.33.0"))}
    assert list(older) == SWEEP and not any(c.log_lines for c in older.values())
    off = replace(factskit.facts("0.34.0"), direct_a2a_default=False)
    assert not any(c.log_lines for c in sweep_cases(off))
    assert [c.name for c in sweep_cases(factskit.facts("0.28.0"))] == [SWEEP[0], *SWEEP[2:]]
    assert [c.name for c in sweep_cases(None)] == [SWEEP[0], *SWEEP[2:]] and sweep_cases(LATEST, tp=1) == []
    assert not [c for c in cases(1, LATEST) if c.name.endswith("-sweep")]


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "RUN_CASE", "tests.engine.fake_run_case")
    monkeypatch.setenv("FAKE_FACTS", json.dumps(LATEST.to_dict()))  # the stand-in resolves as 0.34.0


def _run(tmp_path: Path) -> tuple[dict[str, dict], dict]:
    by = {c.name: c for c in cases(2, LATEST)}
    out = tmp_path / "run"
    out.mkdir()
    records = check.run_jobs([check.Job(by[n], n) for n in SWEEP], tmp_path / "model", out, timeout=120,
                             parallel=4, poll_s=0.05)
    return {r["name"]: r for r in records}, verdict.judge(records, out, None)


def test_the_sweep_runs_and_passes_with_the_stand_in(tmp_path: Path, fake_engine: None) -> None:
    records, summary = _run(tmp_path)
    assert summary["verdict"] == "pass", [(n, r.get("problems")) for n, r in records.items()]
    assert records["dcp-defaults-graph-mtp-sweep"]["log_lines"] == [DIRECT_TOPK_LOG]
    assert records["dcp-defaults-graph-mtp-sweep"]["resolved"]["dcp_comm_backend"] == "a2a"


def test_a_build_that_did_not_build_the_direct_topk_exchange_fails(tmp_path: Path, fake_engine: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NO_DIRECT_TOPK", "1")
    records, summary = _run(tmp_path)
    assert summary["verdict"] == "fail"
    missing = [f"log: no line with {DIRECT_TOPK_LOG!r}"]
    assert records["dcp-defaults-graph-mtp-sweep"]["problems"] == missing
    assert records["dcp-a2a-direct-proj1-graph-mtp-sweep"]["problems"] == missing
    assert records["dcp-agrs-proj1-graph-mtp-sweep"]["verdict"] == "pass"
