"""The engine check's comparison, tolerance, verdicts and case list, on synthetic run outputs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from overlay.engine import check
from overlay.engine.compare import FLOOR, SAFETY, compare, derive_tolerance
from overlay.engine.workload import MAX_MODEL_LEN, PROMPT_LENS, Case, cases, prompts


def _doc(prompt_lps: list[list[float | None]], tokens: list[list[int]], tops: list[list[list[list[float]]]]) -> dict:
    return {"requests": [{"prompt_len": len(p), "prompt_logprobs": p, "tokens": t, "top": tp}
                         for p, t, tp in zip(prompt_lps, tokens, tops, strict=True)]}


def _ref() -> dict:
    return _doc([[None, -1.0, -2.0, -3.0]], [[5, 6, 7]],
                [[[[5, -0.1], [9, -2.5]], [[6, -0.2], [8, -0.25]], [[7, -0.3], [1, -3.0]]]])


def test_identical_runs_match() -> None:
    d = compare(_ref(), _ref(), 0.05)
    assert d.max_abs == 0 and not d.problems(0.05)
    assert d.requests[0].steps_compared == 3


def test_prompt_logprob_shift_is_caught_with_its_position() -> None:
    got = _ref()
    got["requests"][0]["prompt_logprobs"][2] = -2.9
    d = compare(_ref(), got, 0.05)
    assert d.requests[0].prompt_worst_pos == 2
    assert any("prompt logprob off by 0.9 at position 2" in p for p in d.problems(0.05))


def test_greedy_token_change_beyond_tolerance_fails_but_near_tie_only_stops() -> None:
    got = _ref()
    got["requests"][0]["tokens"][0] = 9  # reference margin 2.4: a real change
    d = compare(_ref(), got, 0.05)
    assert d.requests[0].token_mismatch and "greedy token 9 instead of 5" in d.problems(0.05)[0]

    tie = _ref()
    tie["requests"][0]["tokens"][1] = 8  # reference margin 0.05 <= tolerance: a near tie
    tie["requests"][0]["tokens"][2] = 1
    d = compare(_ref(), tie, 0.06)
    assert d.requests[0].tie_divergence and d.requests[0].diverged_at == 1 and not d.problems(0.06)


def test_reference_token_missing_from_top5_fails() -> None:
    got = _ref()
    got["requests"][0]["top"][1] = [[8, -0.1], [3, -1.0]]
    got["requests"][0]["tokens"][1] = 8
    assert "not in the case's top-5" in compare(_ref(), got, 0.05).problems(0.05)[0]


def test_missing_prompt_logprob_is_a_problem() -> None:
    got = _ref()
    got["requests"][0]["prompt_logprobs"][3] = None
    assert "without a logprob" in compare(_ref(), got, 1.0).problems(1.0)[0]


def test_tolerance_is_safety_times_spread_with_a_floor() -> None:
    noisy = _ref()
    noisy["requests"][0]["prompt_logprobs"][1] = -1.1
    tol, spread = derive_tolerance(_ref(), [_ref(), noisy])
    assert spread == pytest.approx(0.1) and tol == pytest.approx(SAFETY * 0.1)
    assert derive_tolerance(_ref(), [_ref()]) == (FLOOR, 0.0)


def test_cases_put_references_then_the_production_shape_first() -> None:
    names = [c.name for c in cases(2)]
    assert names[:3] == ["ref-dcp1", "dcp-a2a-direct-proj1-graph-mtp", "ref-dcp1-reordered"]
    assert len(names) == len(set(names))
    prod = next(c for c in cases(2) if c.name == "dcp-a2a-direct-proj1-graph-mtp")
    kw = prod.engine_kwargs("/m")
    assert kw["decode_context_parallel_size"] == 2 and kw["dcp_comm_backend"] == "a2a"
    assert kw["kv_cache_dtype"] == "fp8_ds_mla" and kw["speculative_config"]["num_speculative_tokens"] == 5
    assert prod.env == {"VLLM_DCP_PROJECT_BEFORE_MERGE": "1", "VLLM_USE_DIRECT_DCP_A2A": "1"}
    assert all(c.dcp == 1 for c in cases(1))
    # every transport, both projection settings, graphs and eager, MTP and the sizing knob are covered
    combos = {(c.backend, c.env.get("VLLM_USE_DIRECT_DCP_A2A"), c.env.get("VLLM_DCP_PROJECT_BEFORE_MERGE"), c.eager)
              for c in cases(2) if c.dcp > 1}
    for backend, direct in (("a2a", "1"), ("a2a", "0"), ("ag_rs", None)):
        for project in ("1", "0"):
            assert (backend, direct, project, False) in combos
        assert (backend, direct, "1", True) in combos
    assert any("VLLM_DCP_DIRECT_WORKSPACE_SIZING" in c.env for c in cases(2))


def test_workload_prompts_exceed_topk_and_the_direct_capacity() -> None:
    ids = prompts(0)
    assert [len(p) for p in ids] == list(PROMPT_LENS) and ids == prompts(0) and ids != prompts(1)
    assert max(PROMPT_LENS) > 8192 and any(2048 < n < 8192 for n in PROMPT_LENS)
    assert max(PROMPT_LENS) + 64 <= MAX_MODEL_LEN


def test_error_line_picks_the_worker_cause() -> None:
    log = "\n".join([
        "INFO starting", "Traceback (most recent call last):",
        "AttributeError: 'FlashMLASparseMetadata' object has no attribute 'decode'",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ])
    assert check.error_line(log).startswith("AttributeError: 'FlashMLASparseMetadata'")
    log = "x\nRuntimeError: ... token count exceeds symmetric buffer capacity"
    assert "token count exceeds" in check.error_line(log)


def _records(tmp: Path, docs: dict[str, tuple[str, dict | None]]) -> list[dict]:
    out = []
    for name, (role, doc) in docs.items():
        if doc is not None:
            (tmp / f"{name}.json").write_text(json.dumps(doc))
        out.append({"case": Case(name, role=role).to_dict(), "status": "ok" if doc else "crashed",
                    "error": "" if doc else "AttributeError: no attribute 'decode'", "wall_s": 1})
    return out


def test_judge_verdicts_and_expected_failures(tmp_path: Path) -> None:
    bad = copy.deepcopy(_ref())
    bad["requests"][0]["prompt_logprobs"][3] = -1.0
    recs = _records(tmp_path, {"ref": ("reference", _ref()), "rerun": ("spread", _ref()),
                               "good": ("check", _ref()), "bad": ("check", bad), "dead": ("check", None)})
    s = check.judge(recs, tmp_path, None)
    assert s["verdict"] == "fail" and s["tolerance"] == FLOOR
    assert {r["case"]["name"]: r["verdict"] for r in recs} == {
        "ref": "reference", "rerun": "spread", "good": "pass", "bad": "fail", "dead": "fail"}
    recs = _records(tmp_path, {"ref": ("reference", _ref()), "dead": ("check", None)})
    assert check.judge(recs, tmp_path, "crash:no attribute 'decode'")["verdict"] == "pass"
    recs = _records(tmp_path, {"ref": ("reference", _ref()), "good": ("check", _ref())})
    assert check.judge(recs, tmp_path, "mismatch")["verdict"] == "fail"  # expected to fail, did not
    recs = _records(tmp_path, {"ref": ("reference", None)})
    assert check.judge(recs, tmp_path, None)["verdict"] == "harness"
    check.report(tmp_path, s, recs, {"model": "m"})
    assert "# Engine check" in (tmp_path / "REPORT.md").read_text()


def test_plot_draws_every_compared_case(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from overlay.engine.plot import bars, draw

    recs = _records(tmp_path, {"ref": ("reference", _ref()), "rerun": ("spread", _ref()), "dead": ("check", None)})
    summary = check.judge(recs, tmp_path, None)
    doc = {"summary": summary, "cases": recs}
    assert [b[0] for b in bars(doc)] == ["rerun", "dead"] and bars(doc)[1][3] == "crashed"
    png = draw([("main", doc)], tmp_path / "e.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
