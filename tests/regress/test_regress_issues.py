"""The regression's exit statuses through make and the cluster script, console reasons, attach timeout,
unknown profile keys and the latency tool of the baseline (issue items 12-16)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from regress_helpers import REPO, free_port, make_profile, run_cli

from overlay.regress.errors import ProfileError
from overlay.regress.profiles import load_profile, parse_profile, shipped_profiles

NVFP4 = "glm5.2-nvfp4-tp8-dcp4-mtp5-a2a"
FAST = "--skip gsm8k,latency"  # long context + acceptance: the collapse shows, in seconds


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", **extra}


def _make(profile: Path, base_url: str, out: Path, args: str = FAST, **extra: str) -> subprocess.CompletedProcess:
    # -o: never refresh the shared venv from here (its stamp is older than pyproject.toml after an edit).
    cmd = ["make", "--no-print-directory", "-o", ".venv/.overlay-tool", "regress", f"PROFILE={profile}",
           f"BASE_URL={base_url}", f"OUT={out}", f"ARGS={args}"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150, env=_env(**extra),
                          check=False)


def _script(profile: Path, base_url: str, out: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    env = _env(BASE_URL=base_url, OUT=str(out), **extra)
    return subprocess.run([str(REPO / "scripts" / "regress.sh"), str(profile), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=150, check=False)


def _verdict(out: Path) -> tuple[str, dict]:
    return (out / "verdict").read_text().strip(), json.loads((out / "verdict.json").read_text())


# 12: make exits 0 for a pass and 2 for anything else; OUT/verdict says regression or harness.
def test_make_regress_exit_status_and_verdict_file(standin, tmp_path: Path) -> None:
    profile = make_profile(tmp_path)
    healthy, collapse = standin("healthy"), standin("collapse")
    ok = _make(profile, healthy.url, tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr
    assert _verdict(tmp_path / "ok")[0] == "pass"
    bad = _make(profile, collapse.url, tmp_path / "bad")
    assert bad.returncode == 2, bad.stderr
    word, doc = _verdict(tmp_path / "bad")
    assert word == "regression" and doc["exit_code"] == 1
    assert doc["reasons"][0].startswith("acceptance: regression: acceptance collapse:")
    assert "make regress: verdict regression (overlay regress exit 1)" in bad.stderr
    closed = _make(profile, f"http://127.0.0.1:{free_port()}", tmp_path / "harness", REGRESS_ATTACH_TIMEOUT="1")
    assert closed.returncode == 2, closed.stderr
    assert _verdict(tmp_path / "harness")[0] == "harness"
    assert "make regress: verdict harness (overlay regress exit 2)" in closed.stderr


def test_make_regress_bad_profile_is_a_harness_verdict(tmp_path: Path) -> None:
    profile = make_profile(tmp_path, **{"server.prot": 1})
    run = _make(profile, "http://127.0.0.1:9", tmp_path / "out")
    assert run.returncode == 2, run.stderr
    word, doc = _verdict(tmp_path / "out")
    assert word == "harness" and "server.prot: unknown field" in doc["reasons"][0]


def test_cluster_script_returns_0_1_2_and_writes_the_verdict(standin, tmp_path: Path) -> None:
    profile = make_profile(tmp_path)
    ok = _script(profile, standin("healthy").url, tmp_path / "ok", "--skip", "gsm8k,latency")
    assert ok.returncode == 0, ok.stderr
    assert _verdict(tmp_path / "ok")[0] == "pass"
    bad = _script(profile, standin("collapse").url, tmp_path / "bad", "--skip", "gsm8k,latency")
    assert bad.returncode == 1 and _verdict(tmp_path / "bad")[0] == "regression"
    closed = _script(profile, f"http://127.0.0.1:{free_port()}", tmp_path / "h", REGRESS_ATTACH_TIMEOUT="1")
    assert closed.returncode == 2 and _verdict(tmp_path / "h")[0] == "harness"


# 13: every finding and every harness failure prints its one-line reason before the verdict line.
def _before_verdict(stderr: str, text: str) -> None:
    verdict_at = stderr.index("] verdict: ")
    assert text in stderr[:verdict_at], stderr


def test_acceptance_finding_reaches_the_console(standin, tmp_path: Path) -> None:
    run = run_cli(make_profile(tmp_path), tmp_path / "out", "--base-url", standin("collapse").url,
                  "--skip", "gsm8k,latency")
    assert run.code == 1
    _before_verdict(run.stderr, "acceptance: regression: acceptance collapse: positions 0..1 near 1.0")


def test_server_step_failures_print_their_reason(standin, tmp_path: Path) -> None:
    wrong = make_profile(tmp_path, **{"server.served_model_name": "other/model"})
    run = run_cli(wrong, tmp_path / "wrong", "--base-url", standin("healthy").url)
    assert run.code == 2
    _before_verdict(run.stderr, "server: harness: http://127.0.0.1:")
    _before_verdict(run.stderr, "not the profile's served model 'other/model'")
    slow = run_cli(make_profile(tmp_path), tmp_path / "slow", "--base-url",
                   standin("healthy", "--start-delay", "60", wait=False).url, "--ready-timeout", "1")
    assert slow.code == 2
    _before_verdict(slow.stderr, "server: harness: server at http://127.0.0.1:")


# 14: attaching to a closed port fails within attach_timeout_s, not the profile's ready_timeout_s.
@pytest.mark.parametrize("how", ["env", "profile", "flag"])
def test_attach_to_a_closed_port_fails_fast(tmp_path: Path, how: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    changes = {"server.attach_timeout_s": 1} if how == "profile" else {}
    env = {"REGRESS_ATTACH_TIMEOUT": "1"} if how == "env" else {"REGRESS_ATTACH_TIMEOUT": "120"}
    flag = ["--attach-timeout", "1"] if how == "flag" else []
    if how == "profile":
        env = {}
    start = time.monotonic()
    run = run_cli(make_profile(tmp_path, **changes), tmp_path / "out", "--base-url", url, *flag, env=env,
                  timeout_s=60)
    assert time.monotonic() - start < 30
    assert run.code == 2, run.stderr
    [finding] = run.findings()
    assert finding["message"].startswith(f"nothing answers at {url}: connection refused for 1 s")
    assert "server.attach_timeout_s" in finding["message"] and "REGRESS_ATTACH_TIMEOUT" in finding["message"]
    _before_verdict(run.stderr, "connection refused for 1 s")


def test_attach_timeout_default_is_short_and_profile_checked() -> None:
    assert load_profile(NVFP4).server.attach_timeout_s == 30.0
    with pytest.raises(ProfileError, match=r"server\.attach_timeout_s: must be > 0"):
        parse_profile(yaml.safe_dump(_mutated(lambda d: d["server"].update(attach_timeout_s=0))), "p.yaml")


# 15: misspelled keys inside sections are refused, each named with the file and the section.
def _nvfp4() -> dict:
    return yaml.safe_load((REPO / "overlay/regress/profiles" / f"{NVFP4}.yaml").read_text())


def _mutated(mutate) -> dict:
    data = _nvfp4()
    mutate(data)
    return data


@pytest.mark.parametrize(("section", "wrong", "right"), [
    ("server", "prot", "port"), ("server", "ready_timout_s", "ready_timeout_s"),
    ("gsm8k", "num_fewshots", "num_fewshot"), ("gsm8k", "limt", "limit"),
    ("long_context", "max_token", "max_tokens"),
])
def test_misspelled_section_keys_are_refused(section: str, wrong: str, right: str) -> None:
    data = _nvfp4()
    data[section][wrong] = data[section].get(right, 1) or 1
    with pytest.raises(ProfileError) as err:
        parse_profile(yaml.safe_dump(data), "p.yaml")
    text = str(err.value)
    assert f"p.yaml: {section}.{wrong}: unknown field (did you mean {right}?)" in text
    assert "\n" not in text


def test_unknown_keys_at_every_level_are_each_named() -> None:
    data = _nvfp4()
    data["baseline"]["gsm8k"]["strict"] = 0.9
    data["baseline"]["latency"]["ttft"] = 1.0
    data["thresholds"]["ttft_max_ratio"]["because"] = "x"
    data["latency"]["tol"] = "builtin"
    with pytest.raises(ProfileError) as err:
        parse_profile(yaml.safe_dump(data), "p.yaml")
    for key in ("baseline.gsm8k.strict", "baseline.latency.ttft", "thresholds.ttft_max_ratio.because",
                "latency.tol"):
        assert f"{key}: unknown field" in str(err.value)


@pytest.mark.parametrize("name", shipped_profiles())
def test_shipped_profiles_have_no_unknown_keys(name: str) -> None:
    assert load_profile(name).name == name


# 16: a baseline records its latency tool; a run with another tool is refused, naming both.
def test_baseline_records_its_latency_tool() -> None:
    assert load_profile(NVFP4).baseline.latency_tool == "vllm-bench"
    with pytest.raises(ProfileError, match=r"baseline\.latency\.tool: missing"):
        parse_profile(yaml.safe_dump(_mutated(lambda d: d["baseline"]["latency"].pop("tool"))), "p.yaml")


def test_latency_tool_mismatch_is_refused() -> None:
    with pytest.raises(ProfileError) as err:
        load_profile(NVFP4).with_overrides(latency_tool="builtin")
    assert str(err.value).startswith("--latency-tool builtin: the baseline in overlay/regress/profiles/"
                                     f"{NVFP4}.yaml (baseline.latency.tool) was measured with vllm-bench")
    assert load_profile(NVFP4).with_overrides(latency_tool="builtin", skip=("latency",)).latency.tool == "builtin"
    mixed = _mutated(lambda d: d["latency"].update(tool="builtin"))
    with pytest.raises(ProfileError, match=r"p.yaml: latency.tool: builtin, but baseline.latency.tool is vllm-bench"):
        parse_profile(yaml.safe_dump(mixed), "p.yaml")


def test_latency_tool_mismatch_through_the_cli_is_a_harness_failure(tmp_path: Path) -> None:
    profile = make_profile(tmp_path, **{"latency.tool": "vllm-bench", "baseline.latency.tool": "vllm-bench"})
    run = run_cli(profile, tmp_path / "out", "--base-url", "http://127.0.0.1:9", "--latency-tool", "builtin")
    assert run.code == 2
    assert "error: --latency-tool builtin: the baseline in" in run.stderr and "measured with vllm-bench" in run.stderr
    assert (tmp_path / "out" / "verdict").read_text().strip() == "harness"
