"""End to end: ``overlay regress`` (what ``make regress BASE_URL=...`` runs) against the stand-in.

lm-eval runs for real on the GSM8K fixture. Each bad mode must fail with its own finding, and
the healthy stand-in must pass with a full report (JSON, Markdown, three PNGs).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from regress_helpers import FIXTURE_GSM8K, REPO, STANDIN, free_port, make_profile, run_cli


def test_healthy_passes_with_full_report(standin, tmp_path: Path) -> None:
    server = standin("healthy")
    run = run_cli(make_profile(tmp_path), tmp_path / "out", "--base-url", server.url + "/v1")
    assert run.code == 0, run.stderr
    assert run.report["verdict"] == "pass"
    assert {s["name"]: s["status"] for s in run.report["steps"]} == {
        "server": "pass", "long_context": "pass", "gsm8k": "pass", "latency": "pass", "acceptance": "pass"}
    gsm8k = run.step("gsm8k")["data"]
    assert gsm8k["samples"] == 10 and gsm8k["strict-match"]["value"] == 1.0
    rates = run.step("acceptance")["data"]["rates"]
    assert [round(r, 2) for r in rates] == [0.97, 0.83, 0.40, 0.39, 0.38]
    long_probes = [p for p in run.step("long_context")["data"]["probes"] if p["min_prompt_tokens"]]
    assert all(p["prompt_tokens"] > 2048 and p["prompt_tokens"] > 1408 for p in long_probes)
    for png in ("acceptance.png", "gsm8k.png", "latency.png"):
        assert (run.out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in (run.out / "report.md").read_text()
    assert "[regress " in run.stderr and "gsm8k: lm-eval gsm8k_local" in run.stderr
    assert "verdict: pass (exit 0)" in run.stderr


def test_repetition_is_caught_by_the_ngram_detector(standin, tmp_path: Path) -> None:
    server = standin("repetition")
    run = run_cli(make_profile(tmp_path), tmp_path / "out", "--base-url", server.url, "--skip", "gsm8k")
    assert run.code == 1, run.stderr
    messages = [f["message"] for f in run.findings("regression")]
    assert any(m.startswith("needle-9000: repetition:") for m in messages), messages
    assert any(m.startswith("count-3000: counting broke: 1..23 consecutive, then 21") for m in messages), messages
    # Short prompts stay healthy in this mode: only the long ones are flagged.
    assert not any(m.startswith(("add-8-2", "count-short", "translate-hello")) for m in messages), messages
    assert run.step("acceptance")["status"] == "pass"


def test_accumulating_corruption_is_caught_by_the_repeated_question(standin, tmp_path: Path) -> None:
    server = standin("accumulate")
    run = run_cli(make_profile(tmp_path), tmp_path / "out", "--base-url", server.url)
    assert run.code == 1, run.stderr
    messages = [f["message"] for f in run.findings("regression")]
    repeated = [m for m in messages if m.startswith("3+4 asked 3 times in a row")]
    assert repeated and "corruption accumulates" in repeated[0], messages
    values = [a["value"] for a in run.step("long_context")["data"]["repeated"]["answers"]]
    assert len(values) == 3 and values[0] < values[1] < values[2]
    # The damage carries into GSM8K, run after the long prompts.
    assert run.step("gsm8k")["status"] == "fail"
    assert any(m.startswith("GSM8K strict-match 0.0000 <") for m in messages), messages


def test_acceptance_collapse_is_caught_from_metrics(standin, tmp_path: Path) -> None:
    server = standin("collapse")
    run = run_cli(make_profile(tmp_path), tmp_path / "out", "--base-url", server.url)
    assert run.code == 1, run.stderr
    assert [f["check"] for f in run.findings()] == ["acceptance"], run.findings()
    assert run.findings()[0]["message"].startswith("acceptance collapse: positions 0..1 near 1.0 then a cliff")
    assert {s["name"]: s["status"] for s in run.report["steps"]}["gsm8k"] == "pass"
    assert (run.out / "acceptance.png").exists()



def test_slow_decoding_is_a_latency_regression(standin, tmp_path: Path) -> None:
    server = standin("healthy", "--tpot-ms", "40")
    run = run_cli(make_profile(tmp_path), tmp_path / "out", "--base-url", server.url,
                  "--skip", "gsm8k,long_context,acceptance")
    assert run.code == 1, run.stderr
    [finding] = run.findings()
    # the stand-in sleeps 40 ms a token: a busy machine makes that longer, never shorter (issue 53 cause 10:
    # "mean_tpot_ms 4..." failed once the scheduler made it 50); the judgement on given numbers is a unit test
    assert finding["check"] == "latency" and finding["message"].startswith("mean_tpot_ms ")
    assert float(finding["message"].split()[1]) >= 40.0
    assert finding["message"].endswith("> 23.00 (baseline 20.00 x 1.15)")
    assert (run.out / "latency.png").exists() and (run.out / "latency" / "latency.json").exists()

def test_server_dying_mid_run_is_a_regression(standin, tmp_path: Path) -> None:
    server = standin("dies")
    run = run_cli(make_profile(tmp_path), tmp_path / "out", "--base-url", server.url)
    assert run.code == 1, run.stderr
    assert server.proc.wait(timeout=10) == 1
    died = run.findings("regression")
    assert len(died) == 1 and died[0]["check"] == "long_context"
    assert died[0]["message"].startswith("server died: stopped answering /health"), died
    statuses = {s["name"]: s["status"] for s in run.report["steps"]}
    assert statuses == {"server": "pass", "long_context": "fail", "gsm8k": "skipped", "latency": "skipped",
                        "acceptance": "skipped"}
    assert "verdict: regression (exit 1)" in run.stderr


def test_slow_start_within_the_readiness_timeout_passes(standin, tmp_path: Path) -> None:
    # The port is bound 10 s after the stand-in starts: well after the CLI, started at the same time,
    # polls it even on a loaded machine (with 3 s, a CLI that took 3 s to import found it ready at
    # once). Latency left out: there, its thresholds would decide, not the readiness wait.
    server = standin("healthy", "--start-delay", "10", wait=False)
    run = run_cli(make_profile(tmp_path), tmp_path / "out", "--base-url", server.url, "--ready-timeout", "60",
                  "--skip", "gsm8k,latency")
    assert run.code == 0, run.stderr
    assert run.step("server")["data"]["ready_s"] >= 2.0


def test_slow_start_past_the_readiness_timeout_is_a_harness_failure(standin, tmp_path: Path) -> None:
    server = standin("healthy", "--start-delay", "60", wait=False)
    run = run_cli(make_profile(tmp_path), tmp_path / "out", "--base-url", server.url, "--ready-timeout", "2")
    assert run.code == 2, run.stderr
    [finding] = run.findings()
    assert finding["kind"] == "harness"
    assert finding["message"].startswith(f"server at {server.url} not ready after 2 s (ConnectError")
    assert "raise server.ready_timeout_s or --ready-timeout" in finding["message"]
    assert {s["name"] for s in run.report["steps"] if s["status"] == "skipped"} == {
        "long_context", "gsm8k", "latency", "acceptance"}


def _fake_vllm(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "vllm"
    script.write_text(f"#!{sys.executable}\n{body}")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_launch_mode_starts_captures_the_log_and_stops_the_server(tmp_path: Path) -> None:
    port = free_port()
    fake = _fake_vllm(tmp_path, f"""
import os, sys
args = sys.argv[1:]
assert args[0] == "serve", args
print("fake vllm:", " ".join(args), flush=True)
spec = args[args.index("--speculative-config") + 1]
os.execv(sys.executable, [sys.executable, {str(STANDIN)!r}, "--port", args[args.index("--port") + 1],
         "--model-name", args[1], "--gsm8k", {str(FIXTURE_GSM8K)!r}, "--start-delay", "1"])
""")
    profile = make_profile(tmp_path, **{"server.vllm_bin": str(fake), "server.port": port})
    run = run_cli(profile, tmp_path / "out", "--skip", "gsm8k,latency", "--ready-timeout", "30")
    assert run.code == 0, run.stderr
    log = (run.out / "server.log").read_text()
    assert log.startswith(f"$ {fake} serve zai-org/GLM-5.2-NVFP4 --host 127.0.0.1 --port {port}")
    assert "fake vllm: serve" in log and "standin: mode healthy" in log
    assert run.report["server_log"] == "server.log"  # relative to the run's folder, no machine path
    # Stopped: nothing listens on the port any more.
    import socket
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_launch_mode_server_exiting_at_startup_is_a_regression(tmp_path: Path) -> None:
    fake = _fake_vllm(tmp_path, "import sys\nprint('RuntimeError: DCP is not supported by FLASHMLA_SPARSE')\n"
                                "sys.exit(3)\n")
    profile = make_profile(tmp_path, **{"server.vllm_bin": str(fake), "server.port": free_port()})
    run = run_cli(profile, tmp_path / "out", "--ready-timeout", "30")
    assert run.code == 1, run.stderr
    [finding] = run.findings()
    assert finding["message"] == ("server died during startup: vllm serve exited with status 3 before it was "
                                  "ready; server log ends: RuntimeError: DCP is not supported by FLASHMLA_SPARSE")


def test_launch_mode_server_refusing_a_profile_argument_is_a_harness_failure(tmp_path: Path) -> None:
    """A profile giving an argument the started vLLM does not take (0.34.0's --dcp-v-up-proj-before-merge on
    0.28.0): argparse stops it at start-up; that is the profile's mismatch with the build, not a regression."""
    fake = _fake_vllm(tmp_path, "import sys\nprint('usage: vllm serve [model_tag] [options]', file=sys.stderr)\n"
                                "print('vllm serve: error: unrecognized arguments: --dcp-v-up-proj-before-merge on',"
                                " file=sys.stderr)\nsys.exit(2)\n")
    profile = make_profile(tmp_path, **{"server.vllm_bin": str(fake), "server.port": free_port()})
    run = run_cli(profile, tmp_path / "out", "--ready-timeout", "30")
    assert run.code == 2, run.stderr
    [finding] = run.findings()
    assert finding["kind"] == "harness"
    assert finding["message"] == (
        "server.args: the vLLM this profile started does not take --dcp-v-up-proj-before-merge on (server.log: "
        "\"unrecognized arguments\") and stopped at start-up; give the arguments that build takes; 0.28.0's series "
        "takes the projection as server.env VLLM_DCP_PROJECT_BEFORE_MERGE=1|0")
    assert (run.out / "verdict").read_text().strip() == "harness"


# What vLLM's validate_environ does at start-up (0.28.0 and 0.34.0): a VLLM_* variable it does not read is
# logged, not refused, and the server starts without it. The fake reads VLLM_USE_DIRECT_DCP_A2A only.
_IGNORING_VLLM = f"""
import os, sys
args = sys.argv[1:]
assert args[0] == "serve", args
for name in sorted(os.environ):
    if name.startswith("VLLM_") and name != "VLLM_USE_DIRECT_DCP_A2A":
        print(f"WARNING 12-07 10:00:00 [interface.py:1500] Unknown vLLM environment variable detected: {{name}}",
              flush=True)
os.execv(sys.executable, [sys.executable, {str(STANDIN)!r}, "--port", args[args.index("--port") + 1],
         "--model-name", args[1], "--gsm8k", {str(FIXTURE_GSM8K)!r}])
"""


def test_launch_mode_server_ignoring_a_profile_variable_is_a_harness_failure(tmp_path: Path) -> None:
    """A profile setting a variable the started vLLM does not read (0.28.0's VLLM_DCP_PROJECT_BEFORE_MERGE on
    0.34.0) does not run what it says: once ready, the run stops with a harness verdict naming the field. A
    variable of the run's own environment that the profile does not set is not the profile's fault."""
    port = free_port()
    profile = make_profile(tmp_path, **{"server.vllm_bin": str(_fake_vllm(tmp_path, _IGNORING_VLLM)),
                                        "server.port": port,
                                        "server.env": {"VLLM_USE_DIRECT_DCP_A2A": "1",
                                                       "VLLM_DCP_PROJECT_BEFORE_MERGE": "1"}})
    run = run_cli(profile, tmp_path / "out", "--ready-timeout", "30", env={"VLLM_OUTER_SETTING": "1"})
    assert run.code == 2, run.stderr
    [finding] = run.findings()
    assert finding["kind"] == "harness"
    where, message = finding["message"].split(": ", 1)  # the report names the file, its folder redacted
    assert where.endswith("/profile.yaml") and f"{profile}: server.env.VLLM_DCP_PROJECT_BEFORE_MERGE: " in run.stderr
    assert message == (
        "server.env.VLLM_DCP_PROJECT_BEFORE_MERGE: the vLLM this profile started does not read it "
        "(server.log: \"Unknown vLLM environment variable detected: VLLM_DCP_PROJECT_BEFORE_MERGE\"), so the "
        "server does not run what the profile says; set it the way that build reads it, or remove it; our 0.34.0 "
        "series takes the projection as --dcp-v-up-proj-before-merge auto|on|off in server.args")
    assert "Unknown vLLM environment variable detected: VLLM_OUTER_SETTING" in (run.out / "server.log").read_text()
    assert (run.out / "verdict").read_text().strip() == "harness"
    assert {s["name"]: s["status"] for s in run.report["steps"]} == {
        "server": "error", "long_context": "skipped", "gsm8k": "skipped", "latency": "skipped", "acceptance": "skipped"}
    import socket
    with socket.socket() as s:  # stopped all the same
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_a_variable_the_log_names_counts_only_where_the_profile_sets_it(tmp_path: Path) -> None:
    from overlay.regress.errors import RegressError
    from overlay.regress.server import Server

    log = tmp_path / "server.log"
    log.write_text("INFO starting\n\x1b[33mWARNING\x1b[0m 12-07 [interface.py:1500] Unknown vLLM environment "
                   "variable detected: VLLM_B\nWARNING Unknown vLLM environment variable detected: VLLM_OUTER\n")
    server = Server("http://127.0.0.1:9", "m", log_path=log)
    assert server.unread_env({"VLLM_A": "1", "VLLM_B": "0", "NCCL_X": "1"}) == ["VLLM_B"]
    server.check_env_read({"VLLM_A": "1"}, "p.yaml")  # the log names no variable the profile sets
    try:
        server.check_env_read({"VLLM_OUTER": "1", "VLLM_B": "0"}, "p.yaml")
    except RegressError as exc:
        assert str(exc).startswith("p.yaml: server.env.VLLM_OUTER, server.env.VLLM_B: the vLLM this profile "
                                   "started does not read them (server.log: ")
        assert "\n" not in str(exc) and "--dcp-v-up-proj-before-merge" not in str(exc)
    else:
        raise AssertionError("no error for two variables the log calls unknown")
    assert Server("http://127.0.0.1:9", "m").unread_env({"VLLM_B": "0"}) == []  # attached: no log of ours


def test_make_regress_passes_profile_base_url_and_out(tmp_path: Path) -> None:
    # Dry run only: the real target would first refresh the shared venv when pyproject changed.
    out = subprocess.run(["make", "--no-print-directory", "-n", "regress", "PROFILE=p.yaml",
                          "BASE_URL=http://127.0.0.1:9", "OUT=o"],
                         cwd=REPO, capture_output=True, text=True, check=True, timeout=30).stdout
    line = next(ln for ln in out.splitlines() if " regress " in ln).rstrip()
    assert "-m overlay regress --profile 'p.yaml' --out \"$out\" --base-url 'http://127.0.0.1:9' || { rc=$?;" in line
    assert "out='o';" in out


def test_cluster_script_runs_the_regression_and_returns_the_verdict(standin, tmp_path: Path) -> None:
    server = standin("collapse")
    out = tmp_path / "out"
    env = {**os.environ, "BASE_URL": server.url, "OUT": str(out), "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([str(REPO / "scripts" / "regress.sh"), str(make_profile(tmp_path)), "--skip",
                           "gsm8k,latency"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.strip() == str(out / "report.md")
    assert json.loads((out / "report.json").read_text())["verdict"] == "regression"
