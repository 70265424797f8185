"""The regression's parsers against what the real vLLM 0.28.0 server and its tools wrote.

The fixtures in ``fixtures/real-0.28.0/`` come from ``scripts/device-regress.sh`` on two H200s
(2026-12-01): the patched 0.28.0 ``vllm serve`` of the tiny GLM-5 checkpoint (TP2, MTP 5),
``vllm bench serve --save-result`` against it, lm-eval 0.4.13 ``local-completions`` on the
local GSM8K fixture, and the profile ``--record-baseline`` wrote from the DCP 1 run; the server's
``/metrics`` text before and after the checks (``metrics-*.txt``) from ``device-regress.sh one-gpu``
(the same server at TP 1 on one H200, 2026-12-01). Every file is kept exactly as written there, so
a parser that only knew our stand-in's version of a format fails here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from regress_helpers import REPO

from overlay.regress import acceptance, gsm8k, latency
from overlay.regress.profiles import load_profile

REAL = REPO / "tests" / "regress" / "fixtures" / "real-0.28.0"
RECORDED = REAL / "recorded-tiny-glm5-tp2-dcp2-mtp5.yaml"


def _bench_json() -> dict[str, Any]:
    return json.loads((REAL / "vllm-bench-serve.json").read_text())


def _run_latency_on(saved: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[
        dict[str, Any], list[Any]]:
    """run_latency with ``vllm bench serve`` replaced by a process that saves ``saved`` where told."""
    profile = load_profile(str(RECORDED))

    def fake_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        assert cmd[len(profile.server.vllm_argv):len(profile.server.vllm_argv) + 2] == ["bench", "serve"]
        out = Path(cmd[cmd.index("--result-dir") + 1]) / cmd[cmd.index("--result-filename") + 1]
        out.write_text(json.dumps(saved))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(latency.subprocess, "run", fake_run)
    server = SimpleNamespace(base_url="http://127.0.0.1:8100", model="tiny-glm5",
                             ensure_alive=lambda *a: None)
    return latency.run_latency(profile, server, tmp_path, lambda _msg: None)  # type: ignore[arg-type]


def test_real_vllm_bench_serve_json_is_read_and_judged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = _bench_json()
    summary, findings = _run_latency_on(saved, tmp_path, monkeypatch)
    assert findings == []
    for key in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                "p99_tpot_ms", "mean_itl_ms"):
        assert summary[key] == saved[key], key
    assert summary["tool"] == "vllm-bench" and summary["baseline"]["tool"] == "vllm-bench"
    # the same file with a TPOT 3x the recorded baseline (limit 2.5x) is a regression, by name
    _, [finding] = _run_latency_on({**saved, "mean_tpot_ms": saved["mean_tpot_ms"] * 3}, tmp_path, monkeypatch)
    assert finding.check == "latency" and finding.kind == "regression"
    assert finding.message.startswith("mean_tpot_ms 71.31 > 59.43 (baseline 23.77 x 2.5)")


def test_recorded_baseline_is_a_valid_profile_holding_the_real_runs_figures() -> None:
    profile = load_profile(str(RECORDED))
    saved = _bench_json()
    assert profile.baseline.mean_ttft_ms == pytest.approx(saved["mean_ttft_ms"], abs=0.01)
    assert profile.baseline.mean_tpot_ms == pytest.approx(saved["mean_tpot_ms"], abs=0.001)
    assert profile.baseline.latency_tool == "vllm-bench"
    assert len(profile.baseline.acceptance_per_position or []) == 5  # MTP with 5 speculative tokens
    assert "--decode-context-parallel-size" in profile.server.args


def test_real_lm_eval_results_file_is_read(tmp_path: Path) -> None:
    results_dir = tmp_path / "results" / "tiny-glm5"
    results_dir.mkdir(parents=True)
    shutil.copy(REAL / "lm-eval-results.json", results_dir / "results_2026-12-01T02-26-32.849460.json")
    raw = json.loads((REAL / "lm-eval-results.json").read_text())["results"]["gsm8k_local"]
    got = gsm8k.read_results(tmp_path / "results", "gsm8k_local")
    assert got["samples"] == 10
    for metric in ("strict-match", "flexible-extract"):
        assert got[metric] == {"value": raw[f"exact_match,{metric}"], "stderr": raw[f"exact_match_stderr,{metric}"]}
    assert gsm8k.judge(load_profile(str(RECORDED)), got) == []


# vLLM 0.28.0's own spec-decode metric family (the class the server's /metrics exposes), fed two
# observations, exposition taken after each: the names, the _total/_created samples and the labels
# (model_name, engine, position) are vLLM's, not ours.
_VLLM_EXPOSITION = """
from types import SimpleNamespace
import prometheus_client
from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats
prom = SpecDecodingProm(SimpleNamespace(num_speculative_tokens=5), ["model_name", "engine"],
                        {0: ["tiny-glm5", "0"], 1: ["tiny-glm5", "1"]})
prom.observe(SpecDecodingStats(5, 10, 50, 12, [6, 3, 2, 1, 0]), 0)
before = prometheus_client.generate_latest().decode()
prom.observe(SpecDecodingStats(5, 100, 500, 90, [50, 25, 10, 5, 0]), 0)
prom.observe(SpecDecodingStats(5, 100, 500, 60, [40, 15, 5, 0, 0]), 1)
print("#BEGIN\\n" + before + "\\n#SPLIT\\n" + prometheus_client.generate_latest().decode())
"""


def test_vllm_0_28_0s_own_spec_decode_exposition_is_parsed() -> None:
    pytest.importorskip("vllm")
    proc = subprocess.run([sys.executable, "-c", _VLLM_EXPOSITION], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before_text, after_text = proc.stdout.split("#BEGIN\n", 1)[1].split("\n#SPLIT\n")  # after vLLM's logs
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="tiny-glm5",position="0"}' \
        in after_text.replace(", ", ",")
    before, after = acceptance.parse_counters(before_text), acceptance.parse_counters(after_text)
    assert before is not None and after is not None
    drafts, rates = acceptance.rates_between(before, after)
    assert drafts == 200  # both engines summed
    assert rates == [0.45, 0.2, 0.075, 0.025, 0.0]


def test_real_server_metrics_text_is_parsed_and_judged() -> None:
    """``/metrics`` of the real 0.28.0 server (device-regress.sh one-gpu: TP 1, MTP 5, one H200), before
    and after the checks: ~90 families besides spec decoding (histograms, gauges, _created samples)."""
    before_text = (REAL / "metrics-before.txt").read_text()
    after_text = (REAL / "metrics-after.txt").read_text()
    assert after_text.count("# TYPE ") > 80
    before, after = acceptance.parse_counters(before_text), acceptance.parse_counters(after_text)
    assert before == acceptance.SpecCounters(0.0, {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0})
    assert after == acceptance.SpecCounters(2662.0, {0: 8.0, 1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0})
    drafts, rates = acceptance.rates_between(before, after)
    assert drafts == 2662.0 and rates == [8 / 2662, 0.0, 0.0, 0.0, 0.0]
    profile = load_profile(str(RECORDED))  # a random MTP layer: per position ~0, as the baseline says
    _, findings = acceptance.judge(profile, before, after)
    assert findings == []
