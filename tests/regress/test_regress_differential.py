"""The differential check against stand-in servers: a reference and a server under test, token prompts.

Two healthy stand-ins agree exactly (pass); one that is 1.5 nats off past index_topk (``skew``:
silent corruption that answers every text question right) is a regression naming where; the
reference can be a server or a recording; a server that dies on the long prompt is "server died".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from regress_helpers import make_profile, run_cli

from overlay.build.fetch import recorded_path
from overlay.regress import differential
from overlay.regress.errors import ProfileError
from overlay.regress.profiles import DifferentialSpec, load_profile
from overlay.regress.reference import ShapeError, parse_reply

# short prompts beside ones past index_topk (2048) and past the workspace capacity
DIFF = {"checks": ["differential"], "checks_off": {"long_context": "the test runs one check", "gsm8k": "ditto"},
        "differential": {"prompt_tokens": [40, 2600, 8], "max_tokens": 8, "request_timeout_s": 30},
        "thresholds.differential_safety": {"value": 3, "why": "3 x the reference's own spread"},
        "thresholds.differential_floor_nats": {"value": 0.0625, "why": "bf16 rounding of a logit of ~8, twice"}}


def _profile(tmp_path: Path) -> Path:
    path = make_profile(tmp_path, **{k: v for k, v in DIFF.items() if not k.startswith("thresholds.")})
    import yaml

    data = yaml.safe_load(path.read_text())
    data["thresholds"] = {k.split(".", 1)[1]: v for k, v in DIFF.items() if k.startswith("thresholds.")}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_parse_choice_reads_vllm_completions_logprobs() -> None:
    choice = {"token_ids": [7, 9], "prompt_logprobs": [None, {"5": {"logprob": -1.5, "rank": 2}},
                                                       {"6": {"logprob": -0.25, "rank": 1}, "8": {"logprob": -3.0}}],
              "logprobs": {"tokens": ["token_id:7", "token_id:9"],
                           "top_logprobs": [{"token_id:7": -0.1, "token_id:3": -2.0}, {"token_id:9": -0.2}]}}
    rec = parse_reply({"choices": [choice]}, [4, 5, 6], "ref")
    assert rec == {"prompt_len": 3, "prompt_logprobs": [None, -1.5, -0.25], "tokens": [7, 9],
                   "top": [[[7, -0.1], [3, -2.0]], [[9, -0.2]]]}
    with pytest.raises(ShapeError, match=r"^ref: the reply has no prompt_logprobs"):
        parse_reply({"choices": [{"logprobs": None}]}, [1, 2], "ref")


def test_prompts_are_seeded_token_ids() -> None:
    spec = DifferentialSpec(prompt_tokens=(5, 3), token_range=(10, 20), seed=1)
    ids = differential.prompt_ids(spec)
    assert [len(p) for p in ids] == [5, 3] and all(10 <= t < 20 for p in ids for t in p)
    assert ids == differential.prompt_ids(spec) != differential.prompt_ids(DifferentialSpec(seed=2))


def test_profile_rules(tmp_path: Path) -> None:
    p = load_profile(str(_profile(tmp_path)))
    assert p.checks == ("differential",) and p.checks_off["gsm8k"] == "ditto"
    assert p.differential.prompt_tokens == (40, 2600, 8)
    bad = make_profile(tmp_path, **{"checks": ["differential"], "differential": {"prompt_tokens": [40, 100]},
                                    "checks_off": {"gsm8k": ""}})
    with pytest.raises(ProfileError) as e:
        load_profile(str(bad))
    text = str(e.value)
    assert "none is longer than index_topk" in text and "checks_off.gsm8k: say why" in text
    assert "thresholds.differential_safety: missing" in text


def test_healthy_matches_a_healthy_reference(standin, tmp_path: Path) -> None:
    ref, test = standin("healthy"), standin("healthy")
    run = run_cli(_profile(tmp_path), tmp_path / "out", "--base-url", test.url, env={"REF_URL": ref.url})
    assert run.code == 0, run.stderr
    step = run.step("differential")
    assert step["status"] == "pass" and step["data"]["diff"]["dense_max_abs"] == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Differential" in md and "| gsm8k | off | | ditto |" in md


def test_silent_corruption_past_topk_is_a_regression(standin, tmp_path: Path) -> None:
    ref, test = standin("healthy"), standin("skew")
    run = run_cli(_profile(tmp_path), tmp_path / "out", "--base-url", test.url, "--ref-url", ref.url)
    assert run.code == 1, run.stderr
    messages = [f["message"] for f in run.findings("regression")]
    # dense positions (context <= index_topk) agree; the distribution beyond it moved
    assert messages == ["beyond index_topk: median deviation 1.5 > 0.0625",
                        "beyond index_topk: 90th-percentile deviation 1.5 > 0.0625"], messages
    assert "differential: regression: beyond index_topk: median deviation 1.5" in run.stderr
    rows = run.step("differential")["data"]["diff"]["requests"]
    assert [round(r["sparse_q50"], 3) for r in rows] == [0, 1.5, 0] and rows[1]["dense_max_abs"] == 0


def test_recorded_reference_round_trip(standin, tmp_path: Path) -> None:
    ref, test = standin("healthy"), standin("skew")
    rec = tmp_path / "ref.json"
    run = run_cli(_profile(tmp_path), tmp_path / "rec", "--base-url", ref.url, "--record-differential", str(rec))
    # the report carries no machine path: the recorded file outside the run's folder by its name
    assert run.code == 0 and run.step("differential")["data"]["recorded"] == recorded_path(rec), run.stderr
    doc = json.loads(rec.read_text())
    assert len(doc["runs"]) == 2 and [r["prompt_len"] for r in doc["runs"][0]["requests"]] == [40, 2600, 8]
    assert run_cli(_profile(tmp_path), tmp_path / "a", "--base-url", ref.url, "--ref-file", str(rec)).code == 0
    assert run_cli(_profile(tmp_path), tmp_path / "b", "--base-url", test.url, "--ref-file", str(rec)).code == 1
    doc["prompts_sha256"] = "0" * 64
    rec.write_text(json.dumps(doc))
    stale = run_cli(_profile(tmp_path), tmp_path / "c", "--base-url", ref.url, "--ref-file", str(rec))
    assert stale.code == 2 and "recorded for other prompts" in stale.stderr


def test_no_reference_is_a_harness_failure(standin, tmp_path: Path) -> None:
    test = standin("healthy")
    run = run_cli(_profile(tmp_path), tmp_path / "out", "--base-url", test.url, env={"REF_URL": ""})
    assert run.code == 2 and "no reference: set REF_URL" in run.stderr


def test_server_dying_on_the_long_prompt_is_server_died(standin, tmp_path: Path) -> None:
    ref, test = standin("healthy"), standin("dies", "--capacity", "1000")
    run = run_cli(_profile(tmp_path), tmp_path / "out", "--base-url", test.url, "--ref-url", ref.url)
    assert run.code == 1, run.stderr
    assert any("server died" in f["message"] for f in run.findings("regression"))


def test_tiny_checkpoint_profiles_point_at_the_generated_checkpoint() -> None:
    from overlay.engine.checkpoint import TinyGlm5Spec, checkpoint_id

    dcp2, dcp1 = load_profile("tiny-glm5-tp2-dcp2-mtp5"), load_profile("tiny-glm5-tp2-dcp1-mtp5")
    for p in (dcp2, dcp1):
        assert Path(p.server.command()[2]).name == checkpoint_id(TinyGlm5Spec(), 0)
        assert not p.server.command()[2].startswith("~") and p.server.speculative_tokens == 5
        assert "long_context" in p.checks_off and "gsm8k" in p.checks  # GSM8K for the harness, not the verdict
    assert dcp2.server.arg_value("--decode-context-parallel-size") == "2" and "differential" in dcp2.checks
    assert dcp1.server.arg_value("--decode-context-parallel-size") == "1" and "differential" in dcp1.checks_off
    # the same engine otherwise: only DCP and its backend differ
    rest = [a for a in dcp2.server.args if a not in ("2", "--dcp-comm-backend", "a2a")]
    assert rest == [a for a in dcp1.server.args if a not in ("1", "2")]
    assert dcp2.differential.prompt_tokens == (100, 3000, 9000, 8, 16, 24, 40)


def test_record_baseline_and_reference_from_the_reference_server(standin, tmp_path: Path) -> None:
    import yaml

    ref = standin("healthy")
    # the reference profile has the differential check off, yet records it when asked
    profile = make_profile(tmp_path, **{"checks": ["acceptance", "latency"],
                                        "checks_off": {"differential": "the reference", "gsm8k": "x",
                                                       "long_context": "x"},
                                        "differential": DIFF["differential"]})
    out_profile, rec = tmp_path / "recorded.yaml", tmp_path / "ref.json"
    run = run_cli(profile, tmp_path / "rec", "--base-url", ref.url, "--record-baseline", str(out_profile),
                  "--record-differential", str(rec))
    assert run.code == 0, run.stderr
    assert rec.exists() and run.step("record-baseline")["summary"] == f"wrote {out_profile}"
    lat = run.step("latency")["data"]
    data = yaml.safe_load(out_profile.read_text())
    assert data["baseline"]["latency"] == {"mean_ttft_ms": round(lat["mean_ttft_ms"], 2),
                                           "mean_tpot_ms": round(lat["mean_tpot_ms"], 3), "tool": "builtin"}
    assert data["baseline"]["acceptance_per_position"] == [0.97, 0.83, 0.4, 0.39, 0.38]
    assert data["baseline"]["source"].startswith("recorded ") and "gsm8k" not in data["baseline"]["source"]
    assert load_profile(str(out_profile)).baseline.mean_ttft_ms == round(lat["mean_ttft_ms"], 2)
