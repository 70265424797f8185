"""The engine check on real GPUs (device): the patched engine matches DCP 1; each seed-bug variant fails.

Runs ``python -m overlay engine-check`` where the patched vLLM imports (``scripts/device-run.sh``).
Two GPUs run the DCP cases; one GPU runs the DCP 1 cases only (references, spread, MTP).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from overlay.engine.variants import build_variants

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _check(out: Path, *args: str, timeout: float = 3 * 3600) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "overlay", "engine-check", "--out", str(out), *args],
                          cwd=REPO, timeout=timeout)
    return proc.returncode, json.loads((out / "results.json").read_text())


def test_engine_matches_dcp1(tmp_path: Path) -> None:
    tp = 2 if _gpus() >= 2 else 1
    rc, doc = _check(tmp_path, "--tp", str(tp), "--parallel", "4")
    assert rc == 0, (tmp_path / "REPORT.md").read_text()
    assert doc["summary"]["verdict"] == "pass"


def test_engine_check_catches_every_seed_bug(tmp_path: Path) -> None:
    if _gpus() < 2:
        pytest.skip("DCP needs two GPUs")
    manifest = build_variants(REPO / "patches", "0.28.0", tmp_path / "variants")
    shown = {name for name, v in manifest["variants"].items() if v["case"]}
    assert {"stock", "minus-sparse-mla-decode-metadata-guard", "minus-dcp-forced-mqa-prefill-rows",
            "minus-dcp-direct-a2a-fallback"} <= shown
    cases = "ref-dcp1,ref-dcp1-reordered," + ",".join(sorted({v["case"] for v in manifest["variants"].values()
                                                              if v["case"]}))
    rc, doc = _check(tmp_path / "run", "--tp", "2", "--parallel", "4", "--cases", cases,
                     "--variants", str(tmp_path / "variants"))
    assert rc == 0, (tmp_path / "run" / "REPORT.md").read_text()
    verdicts = {r["variant"]: r["verdict"] for r in doc["cases"] if r.get("variant")}
    assert verdicts == dict.fromkeys(shown, "expected-fail")
