"""The direct A2A op's stand-in refuses what the compiled op refuses, and nothing else (issue 39 item 3).

``kernel_contracts.check_a2a_arguments`` is the host side of each release's
``direct_dcp_a2a_lse_reduce`` as its ``csrc`` reads; ``kernel_contracts.A2A_CASES`` are the shapes it
is held to (among them the one 0.33.0's projection gave GLM-5's path: latent partials into a workspace
sized for ``v_head_dim``). On a CUDA machine (``-m gpu``, ``OVERLAY_KERNELS`` a folder of
``<release>/_C_stable_libtorch.abi3.so`` taken from each release's wheel) the released op answers every
case, each in a process of its own per release; the answers of one H200 are recorded in
``docs/records/device/kernel-contracts-2026-12-04.json``, and the CPU test holds today's stand-in to them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kernel_contracts as kc
import pytest
from packaging.version import Version

HERE = Path(__file__).resolve().parent
RECORD = HERE.parent.parent / "docs" / "records" / "device" / "kernel-contracts-2026-12-04.json"


def _recorded() -> dict:
    return json.loads(RECORD.read_text(encoding="utf-8"))


def _recorded_releases() -> list[str]:
    return sorted(_recorded()["releases"]) if RECORD.is_file() else ["(no device record)"]


@pytest.mark.parametrize("release", _recorded_releases())
def test_the_stand_in_answers_as_the_released_op_did(release: str) -> None:
    """Every case, the refusal's message (or the sentinel check: every earlier check passed) the
    compiled op of ``release`` gave on one H200, and the stand-in gives today."""
    recorded = _recorded()["releases"][release]["cases"]
    assert set(recorded) == set(kc.A2A_CASES), "a case without a device answer: run the gpu test and record it"
    got = {case: kc.stand_in_answer(Version(release), case) for case in kc.A2A_CASES}
    want = {case: row["real"] for case, row in recorded.items()}
    assert got == want


def test_the_sentinel_stops_every_case_before_a_launch() -> None:
    """No case reaches the kernel: each is refused at its own fault or at the sentinel, the last check."""
    for release in ("0.28.0", "0.33.0"):
        for case in kc.A2A_CASES:
            assert kc.stand_in_answer(Version(release), case) != "accepted", (release, case)


def test_the_projected_workspace_refuses_latent_partials() -> None:
    """The shape of the 0.33.0 GLM-5 crash is among the refusals, in both releases."""
    for release in ("0.28.0", "0.33.0"):
        assert kc.stand_in_answer(Version(release), "latent_partials_projected_workspace") == (
            "combined output has the wrong shape")
        assert kc.stand_in_answer(Version(release), "projected_partials_projected_workspace") == kc.SENTINEL


@pytest.mark.gpu
def test_the_released_op_answers_as_the_stand_in() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    root = os.environ.get("OVERLAY_KERNELS")
    if not root:
        pytest.skip("OVERLAY_KERNELS: a folder of <release>/_C_stable_libtorch.abi3.so")
    record: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "releases": {}}
    mismatches = []
    for lib in sorted(Path(root).glob("*/_C_stable_libtorch.abi3.so")):
        release = lib.parent.name
        proc = subprocess.run([sys.executable, str(HERE / "kernel_contracts.py"), str(lib)], capture_output=True,
                              text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        real = json.loads(proc.stdout.strip().splitlines()[-1])
        cases = {}
        for case in kc.A2A_CASES:
            stand_in = kc.stand_in_answer(Version(release), case)
            cases[case] = {"real": real[case], "stand_in": stand_in, "agree": real[case] == stand_in}
            if real[case] != stand_in:
                mismatches.append((release, case, real[case], stand_in))
        record["releases"][release] = {"cases": cases}
    assert record["releases"], f"no <release>/_C_stable_libtorch.abi3.so under {root}"
    out = os.environ.get("OVERLAY_RECORD_OUT")
    if out:
        Path(out).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    assert not mismatches, mismatches
