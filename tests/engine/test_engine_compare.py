"""The engine check's comparison, tolerance, verdicts and case list, on synthetic run outputs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from overlay.engine import check, verdict
from overlay.engine.compare import FLOOR, SAFETY, Tolerance, compare, derive_tolerance
from overlay.engine.workload import LONG_PROMPT_LENS, MAX_MODEL_LEN, PROMPT_LENS, Case, cases, prompts


def _doc(prompt_lps: list[list[float | None]], tokens: list[list[int]], tops: list[list[list[list[float]]]]) -> dict:
    return {"requests": [{"prompt_len": len(p), "prompt_logprobs": p, "tokens": t, "top": tp}
                         for p, t, tp in zip(prompt_lps, tokens, tops, strict=True)]}


def _ref() -> dict:
    return _doc([[None, -1.0, -2.0, -3.0]], [[5, 6, 7]],
                [[[[5, -0.1], [9, -2.5]], [[6, -0.2], [8, -0.25]], [[7, -0.3], [1, -3.0]]]])


T = Tolerance(0.05, 0.05, 0.05)


def test_identical_runs_match() -> None:
    d = compare(_ref(), _ref(), T)
    assert d.dense_max_abs == 0 and not d.problems(T)
    assert d.requests[0].steps_compared == 3


def test_prompt_logprob_shift_is_caught_with_its_position() -> None:
    got = _ref()
    got["requests"][0]["prompt_logprobs"][2] = -2.9
    d = compare(_ref(), got, T)
    assert d.requests[0].dense_worst == "prompt position 2"
    assert any("logprob off by 0.9 at prompt position 2" in p for p in d.problems(T))


def test_greedy_token_change_beyond_tolerance_fails_but_near_tie_only_stops() -> None:
    got = _ref()
    got["requests"][0]["tokens"][0] = 9  # reference margin 2.4: a real change
    d = compare(_ref(), got, T)
    assert d.requests[0].token_mismatch and "greedy token 9 instead of 5" in d.problems(T)[0]

    tie = _ref()
    tie["requests"][0]["tokens"][1] = 8  # reference margin 0.05 <= tolerance: a near tie
    tie["requests"][0]["tokens"][2] = 1
    tol = Tolerance(0.06, 0.06, 0.06)
    d = compare(_ref(), tie, tol)
    assert d.requests[0].tie_divergence and d.requests[0].diverged_at == 1 and not d.problems(tol)


def test_reference_token_missing_from_top5_fails() -> None:
    got = _ref()
    got["requests"][0]["top"][1] = [[8, -0.1], [3, -1.0]]
    got["requests"][0]["tokens"][1] = 8
    assert "not in the case's top-5" in compare(_ref(), got, T).problems(T)[0]


def test_missing_prompt_logprob_is_a_problem() -> None:
    got = _ref()
    got["requests"][0]["prompt_logprobs"][3] = None
    loose = Tolerance(1.0, 1.0, 1.0)
    assert "without a logprob" in compare(_ref(), got, loose).problems(loose)[0]


def _long(shift: float, flips: int, n: int = 40, topk: int = 10) -> tuple[dict, dict]:
    """A prompt of ``n`` tokens; beyond ``topk`` every deviation is ``shift`` and ``flips`` are 2.0."""
    ref = _doc([[None] + [-1.0] * (n - 1)], [[5]], [[[[5, -0.1]]]])
    got = copy.deepcopy(ref)
    lps = got["requests"][0]["prompt_logprobs"]
    for pos in range(topk + 1, n):
        lps[pos] = -1.0 - shift
    for pos in range(topk + 1, topk + 1 + flips):
        lps[pos] = -3.0
    return ref, got


def test_beyond_topk_rare_boundary_swaps_pass_a_shifted_distribution_fails() -> None:
    ref, swaps = _long(0.0, flips=2)  # 2 of 29 positions swapped a boundary token: like the spread
    tol = Tolerance(0.05, 0.05, 0.05)
    assert not compare(ref, swaps, tol, index_topk=10).problems(tol)
    ref, shifted = _long(0.5, flips=0)  # every position moved: a wrong merge or top-k
    problems = compare(ref, shifted, tol, index_topk=10).problems(tol)
    assert any("median deviation 0.5" in p for p in problems)
    # the same shift inside index_topk is held position by position
    assert compare(ref, shifted, tol, index_topk=100).problems(tol)[0].startswith("request 0")


def test_tolerance_is_safety_times_spread_with_a_floor() -> None:
    noisy = _ref()
    noisy["requests"][0]["prompt_logprobs"][1] = -1.1
    tol, spread = derive_tolerance(_ref(), [_ref(), noisy])
    assert spread["dense_max_abs"] == pytest.approx(0.1) and tol.dense == pytest.approx(SAFETY * 0.1)
    assert tol.sparse_q50 == FLOOR
    assert derive_tolerance(_ref(), [_ref()])[0] == Tolerance(FLOOR, FLOOR, FLOOR)


def test_cases_put_references_then_the_production_shape_first() -> None:
    names = [c.name for c in cases(2)]
    assert names[:4] == ["ref-dcp1", "ref-dcp1-mtp", "dcp-a2a-direct-proj1-graph-mtp", "ref-dcp1-reordered"]
    # MTP cases are held to DCP 1 + MTP, the others to the plain DCP 1 reference
    assert {c.name: c.compare_to for c in cases(2) if c.mtp and c.prompt_lens == PROMPT_LENS} == {
        "ref-dcp1-mtp": "", "dcp-a2a-direct-proj1-graph-mtp": "ref-dcp1-mtp",
        "dcp-agrs-proj1-graph-mtp": "ref-dcp1-mtp", "dcp-a2a-direct-proj1-graph-mtp-il16": "ref-dcp1-mtp",
        "dcp-a2a-direct-fused-graph-mtp": "ref-dcp1-mtp", "ref-dcp1-mtp-eager": "ref-dcp1-mtp"}
    # MTP in graphs: FULL decode graphs of the (1 + 5)-token steps, DCP or not, except with
    # interleave > 1 (prefill paths: piecewise); eager cases are not judged on graphs
    assert {c.name: c.graphs for c in cases(2) if c.mtp and c.prompt_lens == PROMPT_LENS} == {
        "ref-dcp1-mtp": "FULL", "dcp-a2a-direct-proj1-graph-mtp": "FULL", "dcp-agrs-proj1-graph-mtp": "FULL",
        "dcp-a2a-direct-proj1-graph-mtp-il16": "PIECEWISE", "dcp-a2a-direct-fused-graph-mtp": "FULL",
        "ref-dcp1-mtp-eager": ""}
    # the long cases: one ~60,000-token prompt on each transport, against their own DCP 1 + MTP reference
    long = {c.name: c for c in cases(2) if c.prompt_lens == LONG_PROMPT_LENS}
    assert set(long) == {"ref-dcp1-mtp-long", "dcp-a2a-direct-proj1-graph-mtp-long",
                         "dcp-a2a-nccl-proj1-graph-mtp-long", "dcp-agrs-proj1-graph-mtp-long"}
    assert all(c.compare_to == "ref-dcp1-mtp-long" and c.graphs == "FULL" for n, c in long.items() if c.dcp > 1)
    kw = long["dcp-agrs-proj1-graph-mtp-long"].engine_kwargs("/m")
    assert kw["max_model_len"] == 60000 + 64 + 128 and kw["dcp_comm_backend"] == "ag_rs"
    assert Case(**long["ref-dcp1-mtp-long"].to_dict()).to_dict()["prompt_lens"] == [60000]
    il16 = next(c for c in cases(2) if c.interleave > 1).engine_kwargs("/m")
    assert il16["cp_kv_cache_interleave_size"] == 16 and il16["decode_context_parallel_size"] == 2
    assert [c.name for c in cases(1)] == ["ref-dcp1", "ref-dcp1-rerun", "ref-dcp1-reordered", "ref-dcp1-mtp",
                                          "ref-dcp1-mtp-eager"]
    assert len(names) == len(set(names))
    prod = next(c for c in cases(2) if c.name == "dcp-a2a-direct-proj1-graph-mtp")
    kw = prod.engine_kwargs("/m")
    assert kw["decode_context_parallel_size"] == 2 and kw["dcp_comm_backend"] == "a2a"
    assert kw["kv_cache_dtype"] == "fp8_ds_mla" and kw["speculative_config"]["num_speculative_tokens"] == 5
    assert (prod.env, prod.projection) == ({"VLLM_USE_DIRECT_DCP_A2A": "1"}, "on")
    assert all(c.dcp == 1 for c in cases(1))
    # every transport, both projection settings, graphs and eager, MTP and the fused opt-in are covered
    combos = {(c.backend, c.env.get("VLLM_USE_DIRECT_DCP_A2A"), c.projection, c.eager) for c in cases(2) if c.dcp > 1}
    for backend, direct in (("a2a", "1"), ("a2a", "0"), ("ag_rs", None)):
        for project in ("on", "off"):
            assert (backend, direct, project, False) in combos
        assert (backend, direct, "on", True) in combos
    assert any(c.env.get("VLLM_DCP_PROJECT_FUSED") == "1" for c in cases(2))  # the fused opt-in
    assert not any("VLLM_DCP_DIRECT_WORKSPACE_SIZING" in c.env for c in cases(2))  # the knob is gone


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
    log = ("x\n    raise RuntimeError(\nRuntimeError: ... token count exceeds symmetric buffer capacity\n"
           "    raise RuntimeError(")
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
    s = verdict.judge(recs, tmp_path, None)
    assert s["verdict"] == "fail" and s["tolerance"]["dense"] == FLOOR
    assert {r["case"]["name"]: r["verdict"] for r in recs} == {
        "ref": "reference", "rerun": "spread", "good": "pass", "bad": "fail", "dead": "fail"}
    recs = _records(tmp_path, {"ref": ("reference", _ref()), "dead": ("check", None)})
    assert verdict.judge(recs, tmp_path, "crash:no attribute 'decode'")["verdict"] == "pass"
    recs = _records(tmp_path, {"ref": ("reference", _ref()), "good": ("check", _ref())})
    assert verdict.judge(recs, tmp_path, "mismatch")["verdict"] == "fail"  # expected to fail, did not
    recs = _records(tmp_path, {"ref": ("reference", None)})
    assert verdict.judge(recs, tmp_path, None)["verdict"] == "harness"
    verdict.report(tmp_path, s, recs, {"model": "m"})
    assert "# Engine check" in (tmp_path / "REPORT.md").read_text()


def test_plot_draws_every_compared_case(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from overlay.engine.plot import bars, draw

    recs = _records(tmp_path, {"ref": ("reference", _ref()), "rerun": ("spread", _ref()), "dead": ("check", None)})
    summary = verdict.judge(recs, tmp_path, None)
    doc = {"summary": summary, "cases": recs}
    assert [b[0] for b in bars(doc)] == ["rerun", "dead"] and bars(doc)[1][3] == "crashed"
    png = draw([("main", doc)], tmp_path / "e.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_case_is_judged_against_its_own_reference(tmp_path: Path) -> None:
    moved = copy.deepcopy(_ref())
    moved["requests"][0]["prompt_logprobs"][2] = -7.0  # what MTP does to DCP 1's first request
    recs = _records(tmp_path, {"ref": ("reference", _ref()), "ref-mtp": ("reference", moved),
                               "mtp-same": ("check", moved), "mtp-off": ("check", _ref())})
    for r in recs[2:]:
        r["case"]["compare_to"] = "ref-mtp"
    s = verdict.judge(recs, tmp_path, None)
    assert {r["case"]["name"]: r["verdict"] for r in recs} == {
        "ref": "reference", "ref-mtp": "fail", "mtp-same": "pass", "mtp-off": "fail"}
    # the second reference is judged against the first (MTP must not move prompt logprobs)
    assert recs[1]["problems"] and s["verdict"] == "fail"
    recs = _records(tmp_path, {"ref": ("reference", _ref()), "ref-mtp": ("reference", None),
                               "mtp": ("check", moved)})
    recs[2]["case"]["compare_to"] = "ref-mtp"
    verdict.judge(recs, tmp_path, None)
    assert recs[1]["verdict"] == "fail" and recs[2]["problems"] == ["its reference ref-mtp did not run"]


# What vLLM 0.28.0 prints while capturing (tqdm bars end in \r) and when it falls back to piecewise.
FULL_LOG = ("INFO [gpu_model_runner.py:5000] Graph capturing started\n"
            "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##| 67/67 [00:07<00:00]\r"
            "Capturing CUDA graphs (decode, FULL): 50%|#  | 10/20 [00:01<00:01]\r"
            "Capturing CUDA graphs (decode, FULL): 100%|##| 20/20 [00:02<00:00]\n")
PIECEWISE_LOG = ("(EngineCore pid=1) WARNING 12-01 02:20:31 [compilation.py:1459] CUDAGraphMode.FULL_AND_PIECEWISE "
                 "is not supported with spec-decode for attention backend FlashMLASparseBackend (support: "
                 "AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE); setting cudagraph_mode=PIECEWISE\n"
                 "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##| 67/67 [00:07<00:00]\n")


def test_graph_mode_reads_the_capture_lines() -> None:
    from overlay.engine.check import graph_mode

    full = graph_mode(FULL_LOG)
    assert full["mode"] == "FULL" and "Capturing CUDA graphs (decode, FULL)" in full["lines"]
    piecewise = graph_mode(PIECEWISE_LOG)
    assert piecewise["mode"] == "PIECEWISE"
    assert any("setting cudagraph_mode=PIECEWISE" in line for line in piecewise["lines"])
    assert graph_mode("eager: nothing captured")["mode"] == ""


# Model Runner V2 (0.33.0's default), MTP-5 at DCP 1 on one H200 (2026-12-02): the target's bars name
# the mode alone, the drafter's its own ("prefill"/"decode") and do not count
V2_FULL_LOG = ("Capturing CUDA graphs (PIECEWISE):   0%|          | 0/19 [00:00<?, ?it/s]\r"
               "Capturing CUDA graphs (FULL):  12%|#         | 2/16 [00:00<00:00, 16.71it/s]\n"
               "(EngineCore pid=2815) INFO 12-02 20:51:33 [speculator.py:110] Capturing model for speculator...\n"
               "Capturing prefill CUDA graphs (PIECEWISE):   0%|          | 0/19 [00:00<?, ?it/s]\r"
               "Capturing decode CUDA graphs (FULL):   0%|          | 0/19 [00:00<?, ?it/s]\n")
V2_DRAFTER_ONLY_LOG = "Capturing CUDA graphs (PIECEWISE): 100%\nCapturing decode CUDA graphs (FULL): 100%\n"


def test_graph_mode_reads_model_runner_v2s_capture_lines() -> None:
    from overlay.engine.check import graph_mode

    full = graph_mode(V2_FULL_LOG)
    assert full == {"mode": "FULL", "lines": ["Capturing CUDA graphs (PIECEWISE)", "Capturing CUDA graphs (FULL)"]}
    assert graph_mode(V2_DRAFTER_ONLY_LOG)["mode"] == "PIECEWISE"  # the drafter's FULL graphs are not the target's


def test_rejudge_reads_the_graphs_from_each_log_again(tmp_path) -> None:
    """A run judged before a capture rule was known is judged again from its logs (``--rejudge``)."""
    from overlay.engine.check import rejudge

    for name in ("ref-dcp1", "ref-dcp1-mtp"):
        (tmp_path / f"{name}.json").write_text(json.dumps(_ref()))
    (tmp_path / "ref-dcp1-mtp.log").write_text(V2_FULL_LOG)
    cases = [{"case": {"name": "ref-dcp1", "role": "reference"}, "name": "ref-dcp1", "status": "ok"},
             {"case": {"name": "ref-dcp1-mtp", "role": "reference", "graphs": "FULL"}, "name": "ref-dcp1-mtp",
              "status": "ok", "graphs": {"mode": "", "lines": []}}]
    (tmp_path / "results.json").write_text(json.dumps({"meta": {"vllm": "0.33.0"}, "cases": cases}))
    assert rejudge(tmp_path, None) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [c["verdict"] for c in doc["cases"]] == ["reference", "reference"]
    assert doc["cases"][1]["graphs"]["mode"] == "FULL" and doc["meta"] == {"vllm": "0.33.0"}


def test_a_case_with_the_wrong_graph_mode_fails(tmp_path) -> None:
    from overlay.engine.check import graph_mode
    from overlay.engine.verdict import judge

    docs = {"ref-dcp1": _ref(), "ref-dcp1-mtp": _ref(), "dcp-mtp": _ref()}
    for name, doc in docs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    records = [
        {"name": "ref-dcp1", "case": {"name": "ref-dcp1", "role": "reference"}, "status": "ok",
         "graphs": graph_mode(FULL_LOG)},
        {"name": "ref-dcp1-mtp", "case": {"name": "ref-dcp1-mtp", "role": "reference", "graphs": "FULL"},
         "status": "ok", "graphs": graph_mode(FULL_LOG)},
        {"name": "dcp-mtp", "case": {"name": "dcp-mtp", "role": "check", "graphs": "FULL",
                                     "compare_to": "ref-dcp1-mtp"}, "status": "ok",
         "graphs": graph_mode(PIECEWISE_LOG)},
    ]
    summary = judge(records, tmp_path, None)
    assert [r["verdict"] for r in records] == ["reference", "reference", "fail"]
    assert records[2]["problems"] == ["graphs: expected FULL decode graphs, the log shows PIECEWISE"]
    assert summary["verdict"] == "fail"


def test_the_mtp_reference_is_judged_against_dcp1(tmp_path) -> None:
    """MTP must not move prompt logprobs (they come from the target alone)."""
    from overlay.engine.verdict import judge

    moved = _ref()
    moved["requests"][0]["prompt_logprobs"][1] = -9.0
    for name, doc in {"ref-dcp1": _ref(), "ref-dcp1-mtp": moved}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    records = [{"name": "ref-dcp1", "case": {"name": "ref-dcp1", "role": "reference"}, "status": "ok"},
               {"name": "ref-dcp1-mtp", "case": {"name": "ref-dcp1-mtp", "role": "reference"}, "status": "ok"}]
    assert judge(records, tmp_path, None)["verdict"] == "fail"
    assert records[1]["verdict"] == "fail" and records[1]["problems"]


def test_the_long_reference_is_not_compared_with_the_short_workload(tmp_path) -> None:
    from overlay.engine.verdict import judge

    long_doc = _ref()
    long_doc["requests"] = long_doc["requests"][:1]
    for name, doc in {"ref-dcp1": _ref(), "ref-long": long_doc, "dcp-long": long_doc}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    records = [{"name": "ref-dcp1", "case": {"name": "ref-dcp1", "role": "reference"}, "status": "ok"},
               {"name": "ref-long", "case": {"name": "ref-long", "role": "reference", "prompt_lens": [60000]},
                "status": "ok"},
               {"name": "dcp-long", "case": {"name": "dcp-long", "role": "check", "prompt_lens": [60000],
                                             "compare_to": "ref-long"}, "status": "ok"}]
    assert judge(records, tmp_path, None)["verdict"] == "pass"
    assert [r["verdict"] for r in records] == ["reference", "reference", "pass"]
