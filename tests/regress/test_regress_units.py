"""Unit tests of the regression's parts: profile validation, detectors, metrics parsing, judging."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import prometheus_client
import pytest
import yaml
from regress_helpers import REPO, pinned_profile

from overlay.regress import acceptance, gsm8k, latency
from overlay.regress.checks import THRESHOLDS
from overlay.regress.errors import ProfileError
from overlay.regress.profiles import load_profile, parse_profile, shipped_profiles
from overlay.regress.textchecks import count_run, last_int, repetition

NVFP4 = "glm5.2-nvfp4-tp8-dcp4-mtp5-a2a"


def _nvfp4_data() -> dict:
    return yaml.safe_load((REPO / "overlay/regress/profiles" / f"{NVFP4}.yaml").read_text())


@pytest.mark.parametrize("name", ["glm5.2-fp8-tp8-dcp8", NVFP4])
def test_shipped_profiles_load_with_the_seed_baselines(name: str) -> None:
    p = load_profile(name)
    assert p.baseline.gsm8k == {"strict-match": 0.9473, "flexible-extract": 0.9466}
    assert p.baseline.gsm8k_stderr == 0.0044
    assert (p.baseline.mean_ttft_ms, p.baseline.mean_tpot_ms) == (795.75, 17.61)
    needed = {t for c in p.checks for t in THRESHOLDS[c]}
    assert set(p.thresholds) == needed and all(len(t.why) > 40 for t in p.thresholds.values())
    assert max(p.long_context.prompt_tokens) > max(2048, p.long_context.workspace_capacity_tokens)


def guide_profiles() -> list[str]:
    """The profiles ``docs/regress/README.md`` lists as shipped (its "The shipped profiles" bullets)."""
    guide = (REPO / "docs" / "regress" / "README.md").read_text()
    listed = guide.split("The shipped profiles", 1)[1].split("\n\n", 2)[1]
    return re.findall(r"(?m)^- `([^`]+)`:", listed)


@pytest.mark.parametrize("name", shipped_profiles())
def test_every_shipped_profile_is_in_the_guides_list(name: str) -> None:
    assert name in guide_profiles(), f"overlay/regress/profiles/{name}.yaml is missing from docs/regress/README.md's " \
                                     "list of shipped profiles"


def test_the_guide_lists_only_shipped_profiles() -> None:
    gone = [n for n in guide_profiles() if n not in shipped_profiles()]
    assert gone == [], f"docs/regress/README.md lists {gone}, not in overlay/regress/profiles/"


def test_profile_details_match_the_seed_commands() -> None:
    fp8 = load_profile("glm5.2-fp8-tp8-dcp8").server
    assert fp8.command()[:3] == ["vllm", "serve", "zai-org/GLM-5.2-FP8"]
    assert fp8.arg_value("--decode-context-parallel-size") == "8" and fp8.speculative_tokens == 0
    nv = load_profile(NVFP4)
    assert nv.server.arg_value("--dcp-comm-backend") == "a2a"
    assert nv.server.arg_value("--max-num-batched-tokens") == "8192" and nv.server.speculative_tokens == 5
    assert nv.baseline.acceptance_per_position == (0.97, 0.83, 0.40, 0.39, 0.38)


def test_a_threshold_set_on_one_profile_changes_that_profiles_verdict_only(tmp_path: Path) -> None:
    """A threshold is its profile's own: set in one profile's ``thresholds:``, it moves that profile's
    verdict on the same run and no other profile's (the tests judge with their own, ``PINNED``)."""
    folder = tmp_path / "profiles"
    shutil.copytree(REPO / "overlay" / "regress" / "profiles", folder)
    before = {name: load_profile(str(folder / f"{name}.yaml")) for name in shipped_profiles()}
    own = before[NVFP4].threshold("tpot_max_ratio")
    data = _nvfp4_data()
    data["thresholds"]["tpot_max_ratio"]["value"] = own * 2
    (folder / f"{NVFP4}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    after = {name: load_profile(str(folder / f"{name}.yaml")) for name in shipped_profiles()}
    for name, profile in before.items():
        if "latency" not in profile.checks:
            continue
        base = profile.baseline
        run = {"completed": 1, "failed": 0, "mean_ttft_ms": base.mean_ttft_ms,  # TPOT 1.5 x NVFP4's threshold
               "mean_tpot_ms": base.mean_tpot_ms * own * 1.5}
        was, now = latency.judge(profile, run), latency.judge(after[name], run)
        if name == NVFP4:
            assert [f.check for f in was] == ["latency"] and now == [], (was, now)
        else:
            assert now == was, f"{name}: its verdict moved with {NVFP4}'s threshold"
            assert after[name].thresholds == profile.thresholds, name


def _broken(mutate) -> str:
    data = _nvfp4_data()
    mutate(data)
    with pytest.raises(ProfileError) as err:
        parse_profile(yaml.safe_dump(data), "p.yaml")
    return str(err.value)


@pytest.mark.parametrize(("mutate", "message"), [
    pytest.param(lambda d: d["thresholds"]["ttft_max_ratio"].pop("why"),
                 "p.yaml: thresholds.ttft_max_ratio.why: missing", id="threshold-without-why"),
    pytest.param(lambda d: d["thresholds"].pop("acceptance_cliff"),
                 "p.yaml: thresholds.acceptance_cliff: missing (needed by the checks this profile runs)",
                 id="threshold-missing"),
    pytest.param(lambda d: d["thresholds"].update(speed={"value": 1, "why": "x"}),
                 "p.yaml: thresholds.speed: unknown threshold", id="unknown-threshold"),
    pytest.param(lambda d: d["long_context"].update(prompt_tokens=[1000]),
                 "p.yaml: long_context.prompt_tokens: none is longer than index_topk 2048", id="prompts-too-short"),
    pytest.param(lambda d: d["baseline"].update(acceptance_per_position=[0.9, 0.8]),
                 "p.yaml: baseline.acceptance_per_position: 2 positions, but --speculative-config drafts 5",
                 id="acceptance-length"),
    pytest.param(lambda d: d["server"]["args"].append(8),
                 "p.yaml: server.args: every argument must be a string", id="unquoted-number"),
    pytest.param(lambda d: d["gsm8k"].update(concurrency=0),
                 "p.yaml: gsm8k.concurrency: must be > 0, got 0", id="zero-concurrency"),
    pytest.param(lambda d: d["latency"].update(tool="ab"),
                 "p.yaml: latency.tool: 'ab' is not one of vllm-bench, builtin", id="latency-tool"),
    pytest.param(lambda d: d.update(extra=1), "p.yaml: extra: unknown field", id="unknown-field"),
])
def test_profile_errors_name_the_field(mutate, message: str) -> None:
    assert _broken(mutate).startswith(message)


def test_profile_errors_are_collected_and_yaml_errors_give_the_line(tmp_path: Path) -> None:
    text = _broken(lambda d: (d["gsm8k"].update(concurrency=0), d["latency"].update(tool="ab")))
    assert "gsm8k.concurrency" in text and "latency.tool" in text
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nserver: [unclosed\n")
    with pytest.raises(ProfileError, match=r"^.*bad\.yaml: line 3 not valid YAML"):
        load_profile(str(bad))
    with pytest.raises(ProfileError, match=r"^no profile 'glm9' \(shipped: glm5\.2-fp8-tp8-dcp8, "):
        load_profile("glm9")


@pytest.mark.parametrize(("text", "consecutive", "broken"), [
    pytest.param(" ".join(map(str, range(1, 201))), 200, False, id="full"),
    pytest.param("Sure: 1, 2, 3, 4, 5", 5, False, id="truncated-is-not-broken"),
    pytest.param("1 2 3 4 5 5 5 5", 5, True, id="repeats"),
    pytest.param("1 2 3 7 8 9", 3, True, id="skips"),
    pytest.param("counting is fun", 0, False, id="no-numbers"),
])
def test_count_run(text: str, consecutive: int, broken: bool) -> None:
    run = count_run(text)
    assert (run.consecutive, run.broken) == (consecutive, broken)


def test_repetition_detector_separates_loops_from_healthy_text() -> None:
    assert repetition(" ".join(map(str, range(1, 201))), 4).duplicate_ratio == 0.0
    prose = ("The quiet river crossed the golden garden near the market, and the harbor lights came on while "
             "the ancient bridge carried travellers toward the distant forest before nightfall arrived.")
    assert repetition(prose, 4).duplicate_ratio < 0.1
    loop = repetition("The code is 42 " + "and so the answer is the answer is " * 30, 4)
    assert loop.duplicate_ratio > 0.8 and loop.top_count >= 29
    assert repetition("7", 4).duplicate_ratio == 0.0
    assert last_int("3 + 4 = 7.") == 7 and last_int("none") is None


def _exposition(drafts: float, accepted: list[float]) -> str:
    """/metrics as vLLM writes it: prometheus_client counters, two engines."""
    registry = prometheus_client.CollectorRegistry()
    d = prometheus_client.Counter("vllm:spec_decode_num_drafts", "d", ["engine", "model_name"], registry=registry)
    a = prometheus_client.Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "a",
                                  ["engine", "model_name", "position"], registry=registry)
    for engine in ("0", "1"):
        d.labels(engine, "m").inc(drafts / 2)
        for pos, value in enumerate(accepted):
            a.labels(engine, "m", str(pos)).inc(value / 2)
    return prometheus_client.generate_latest(registry).decode()


def test_acceptance_rates_are_deltas_over_the_run_summed_over_engines() -> None:
    before = acceptance.parse_counters(_exposition(100, [90, 50, 10]))
    after = acceptance.parse_counters(_exposition(300, [290, 210, 90]))
    assert before is not None and after is not None
    drafts, rates = acceptance.rates_between(before, after)
    assert drafts == 200 and rates == [1.0, 0.8, 0.4]
    assert acceptance.parse_counters("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n") is None


@pytest.mark.parametrize(("rates", "collapsed"), [
    pytest.param([1.000, 1.000, 0.260, 0.2, 0.1], True, id="seed-collapse"),
    pytest.param([1.0, 0.995, 0.999, 0.99, 1.0], True, id="never-rejected"),
    pytest.param([0.97, 0.83, 0.40, 0.39, 0.38], False, id="seed-healthy"),
    pytest.param([0.89, 0.54, 0.39, 0.30, 0.25], False, id="seed-healthy-hard-prompts"),
    pytest.param([0.995, 0.90, 0.70, 0.5, 0.4], False, id="easy-prompts-no-cliff"),
])
def test_collapse_signature(rates: list[float], collapsed: bool) -> None:
    assert (acceptance.collapse_signature(rates, 0.99, 0.4) is not None) is collapsed


def test_gsm8k_floor_uses_combined_standard_errors() -> None:
    p = pinned_profile(NVFP4)
    # 0.93 passes with the run's own stderr 0.007 (floor 0.9225) but fails without it (floor 0.9341).
    results = {"strict-match": {"value": 0.93, "stderr": 0.007}, "flexible-extract": {"value": 0.93, "stderr": 0.0}}
    [finding] = gsm8k.judge(p, results)
    assert finding.message == "GSM8K flexible-extract 0.9300 < 0.9334 (baseline 0.9466 - 3 combined stderr)"
    assert results["strict-match"]["allowed_min"] == 0.9225
    assert gsm8k.allowed_minimum(0.9473, 0.0044, 0.0, 3) == pytest.approx(0.9341)


def test_latency_judges_vllm_bench_saved_json() -> None:
    p = pinned_profile(NVFP4)
    # The keys `vllm bench serve --save-result` writes (seed run: 795.75 / 17.61 ms).
    seed = {"completed": 1, "failed": 0, "mean_ttft_ms": 795.75, "median_ttft_ms": 795.75,
            "mean_tpot_ms": 17.61, "median_tpot_ms": 17.61, "mean_itl_ms": 22.9}
    assert latency.judge(p, seed) == []
    slow = {**seed, "mean_tpot_ms": 21.0}
    [finding] = latency.judge(p, slow)
    assert finding.message == "mean_tpot_ms 21.00 > 20.25 (baseline 17.61 x 1.15)"
    [failed] = latency.judge(p, {**seed, "completed": 0, "failed": 1, "errors": ["EngineDeadError"]})
    assert failed.message == "1 of 1 benchmark requests failed: EngineDeadError"
