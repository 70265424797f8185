"""dcp-project-before-merge: the Triton kernels that project into each transport's layout.

``vllm.v1.attention.ops.dcp_project`` computes the W_UV projection of every gathered head and
stores it where the transport reads it (ag_rs reduce-scatter chunks already LSE-corrected,
NCCL a2a send rows with the LSE bits, the direct a2a peers' symmetric receive slots with the
epoch/signal protocol), and merges N partials with zero weight giving exactly 0.
``dcp_project_kernels_check.py`` runs them with one process standing in for every rank and
compares the merged heads with a float64 merge-then-project reference (2 and 4 ranks, NaN
partials in masked rows, both parity slots of the direct workspace). On CPU it runs under
Triton's interpreter (in fp16: the interpreter mishandles bf16 dots); the ``gpu`` test runs
the compiled kernels in bf16. The unpatched base has no such module, so both fail there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import compat
import pytest
from dcp_project_kernels_check import MISSING

CHECK = Path(__file__).with_name("dcp_project_kernels_check.py")
REL_TOL = 8e-3  # as the harness: a few bf16/fp16 roundings of the merged output


def _run_check(interpret: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    if proc.returncode == MISSING:
        raise compat.BehaviourFailure(proc.stderr.strip().splitlines()[-1])
    if proc.returncode != 0:
        raise compat.HarnessError(f"{CHECK.name} exited {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_exact(result: dict) -> None:
    names = {c["name"].split()[0] for c in result["checks"]}
    assert names == {"masked_lse", "ag_rs", "nccl_a2a", "direct_a2a"}, names
    for c in result["checks"]:
        if c["name"] == "masked_lse":
            assert c["err"] == 0, "masked_lse must mark exactly mask_dcp_empty_shards_'s rows"
        else:
            assert c["err"] <= REL_TOL * c["ref_max"], c


def test_kernels_match_float64_reference_interpreted() -> None:
    pytest.importorskip("triton")
    result = _run_check(interpret=True)
    assert result["device"] == "cpu"
    _assert_exact(result)


@pytest.mark.gpu
def test_kernels_match_float64_reference_gpu() -> None:
    result = _run_check(interpret=False)
    assert result["device"] == "cuda"
    _assert_exact(result)
