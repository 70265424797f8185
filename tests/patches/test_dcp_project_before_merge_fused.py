"""dcp-project-before-merge-fused: the opt-in Triton kernels that project into each transport's layout.

``vllm.v1.attention.ops.dcp_project`` computes the W_UV projection of every gathered head and
stores it where the transport reads it (ag_rs reduce-scatter chunks already LSE-corrected,
NCCL a2a send rows with the LSE bits, the direct a2a peers' symmetric receive slots with the
epoch/signal protocol), and merges N partials with zero weight giving exactly 0.
``dcp_project_kernels_check.py`` runs them with one process standing in for every rank and
compares the merged heads with a float64 merge-then-project reference (2 and 4 ranks, NaN
partials in masked rows, both parity slots of the direct workspace). On CPU it runs under
Triton's interpreter (in fp16: the interpreter mishandles bf16 dots); the ``gpu`` test runs
the compiled kernels in bf16, and the direct path's dispatch and merge captured in a CUDA graph,
replayed twice (both parity slots). The unpatched base has no such module, so these fail there.

Also: ``VLLM_DCP_PROJECT_FUSED`` is off by default and, on, gives each transport's manager its
fused function; and (one H200) a peer that never signals ends the direct merge within its bound
with the kernel's message naming the rank, not a hang.
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


def _run_check(interpret: bool, **extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **extra)
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


@pytest.mark.parametrize(("env", "transport", "expected"), [
    (None, "ag_rs", None), (None, "nccl_a2a", None), (None, "direct_a2a", None),
    ("1", "ag_rs", "project_reduce_scatter"), ("1", "nccl_a2a", "project_all_to_all"),
    ("1", "direct_a2a", "_fused_project_direct"), ("0", "direct_a2a", None),
])
def test_opt_in_picks_the_transports_fused_function(monkeypatch: pytest.MonkeyPatch, env: str | None,
                                                    transport: str, expected: str | None) -> None:
    """Off unless ``VLLM_DCP_PROJECT_FUSED=1``; on, the manager's combine set-up hands
    ``project_combine`` the fused function of its transport (the direct one bound to its workspace)."""
    import functools

    import torch

    if env is None:
        monkeypatch.delenv("VLLM_DCP_PROJECT_FUSED", raising=False)
    else:
        monkeypatch.setenv("VLLM_DCP_PROJECT_FUSED", env)
    dcp = compat.module("dcp")
    workspace = object()
    monkeypatch.setattr(dcp, "get_direct_dcp_a2a_workspace",
                        lambda *a, **k: workspace if transport == "direct_a2a" else None)
    manager = dcp.MLADCPManager.__new__(dcp.MLADCPManager)
    manager.group, manager.device, manager.max_num_tokens, manager.num_ubatches = object(), "cpu", 64, 1
    manager.use_a2a, manager.padded_num_heads = transport != "ag_rs", None
    manager.project_first_min_tokens = 0
    manager.fused_project_combine = None
    with compat.exercising("MLADCPManager._init_combine"):
        manager._init_combine(8, 256, torch.bfloat16, True, False)
    fused = compat.added(manager, "fused_project_combine")
    if expected is None:
        assert fused is None
        return
    assert isinstance(fused, functools.partial)
    func = fused.func
    assert getattr(func, "__name__", None) == expected, func
    if transport == "direct_a2a":
        assert fused.args == (workspace,)


@pytest.mark.gpu
def test_unanswered_peer_ends_in_an_error_within_its_bound() -> None:
    """One H200: rank 0's direct merge waits for a rank 1 that never signals; with a bound of 10^6
    polls it must fail the launch with the kernel's message (op, rank, source, epoch) in seconds."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               DCP_PROJECT_UNANSWERED_PEER=str(10**6))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    if proc.returncode == MISSING:
        raise compat.BehaviourFailure(proc.stderr.strip().splitlines()[-1])
    out = proc.stdout + proc.stderr
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    report = Path(os.environ.get("P9_REPORT_DIR", "."), "unanswered_peer.json")
    report.write_text(json.dumps({**result, "returncode": proc.returncode, "output_tail": out[-4000:]},
                                 indent=1))
    assert proc.returncode == 1 and result["error"], out[-3000:]
    assert "dcp_project direct merge timeout: rank, source, epoch" in out, out[-3000:]
    assert result["seconds"] < 120, result
