"""Helpers for the regression tests: ports, the stand-in command, a test profile, the CLI runner."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from overlay.regress.profiles import Profile

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STANDIN = HERE / "standin.py"
FIXTURE_GSM8K = HERE / "fixtures" / "gsm8k"
PROFILE = "glm5.2-nvfp4-tp8-dcp4-mtp5-a2a"
MODEL = "zai-org/GLM-5.2-NVFP4"
# The thresholds the tests judge with, never a shipped profile's: a threshold set on one profile
# (its file's ``thresholds:``) changes that profile's verdicts and no test of how a check judges.
PINNED = {"gsm8k_max_stderrs": 3, "count_min_consecutive": 150, "repetition_ngram": 4, "repetition_max_ratio": 0.3,
          "acceptance_near_one": 0.99, "acceptance_cliff": 0.4, "acceptance_max_drop": 0.35,
          "ttft_max_ratio": 1.25, "tpot_max_ratio": 1.15}
PINNED_WHY = "the tests' own value (tests/regress/regress_helpers.py:PINNED), not a shipped profile's"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


def standin_command(port: int, mode: str, *extra: str) -> list[str]:
    return [sys.executable, str(STANDIN), "--port", str(port), "--mode", mode, "--model-name", MODEL,
            "--gsm8k", str(FIXTURE_GSM8K), *extra]


def pinned_profile(name: str = PROFILE) -> Profile:
    """A shipped profile judging with the tests' thresholds (:data:`PINNED`) instead of its own."""
    from overlay.regress.profiles import Threshold, load_profile

    return replace(load_profile(name), thresholds={k: Threshold(v, PINNED_WHY) for k, v in PINNED.items()})


def make_profile(tmp_path: Path, **changes: object) -> Path:
    """The shipped NVFP4 profile, sized for the stand-in: local GSM8K, builtin latency, stand-in baselines,
    the tests' thresholds (:data:`PINNED`).

    Changes are dotted keys (``{"latency.input_len": 256}``).
    """
    from overlay.regress.profiles import load_profile

    path = Path(load_profile(PROFILE).path)
    data = yaml.safe_load((REPO / path).read_text())
    data["thresholds"] = {k: {"value": v, "why": PINNED_WHY} for k, v in PINNED.items()}
    data["gsm8k"].update(data=str(FIXTURE_GSM8K), concurrency=4)
    data["latency"].update(tool="builtin", input_len=512, output_len=64, timeout_s=60)
    data["long_context"].update(request_timeout_s=30)
    # The stand-in (TTFT 20 ms, TPOT 0.5 ms) is far faster than an 8xH100 node; the baseline sits
    # well above its healthy numbers so a loaded CI machine does not fail the healthy runs.
    data["baseline"]["latency"] = {"mean_ttft_ms": 400.0, "mean_tpot_ms": 20.0, "tool": "builtin"}
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    out = tmp_path / "profile.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


@dataclass
class CliRun:
    code: int
    stderr: str
    report: dict[str, object]
    out: Path

    def findings(self, kind: str | None = None) -> list[dict[str, str]]:
        steps = self.report["steps"]
        assert isinstance(steps, list)
        return [f for s in steps for f in s["findings"] if kind is None or f["kind"] == kind]

    def step(self, name: str) -> dict[str, object]:
        steps = self.report["steps"]
        assert isinstance(steps, list)
        return next(s for s in steps if s["name"] == name)


def run_cli(profile: Path | str, out: Path, *args: str, timeout_s: float = 150,
            env: dict[str, str] | None = None) -> CliRun:
    """``python -m overlay regress`` as a user runs it; returns exit code, stderr and report.json."""
    cmd = [sys.executable, "-m", "overlay", "regress", "--profile", str(profile), "--out", str(out), *args]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    return CliRun(proc.returncode, proc.stderr, report, out)
