"""dcp-direct-a2a-fallback: above capacity the A2A combine takes vLLM's NCCL ``dcp_a2a_lse_reduce``.

The direct A2A ``lse_reduce`` workspace holds ``get_dcp_workspace_max_num_tokens`` tokens
(decode-sized); on 0.28.0 a forced-MQA prefill step above it kills the engine with "token
count exceeds symmetric buffer capacity". Two real gloo ranks and the real ``MLADCPManager``:
decode-only (2 rows), mixed batches at capacity, capacity + 1 and prefill size; each result is
checked against the float64 reference. The workspace keeps the release's own (decode) sizing:
no sizing knob.
"""

from __future__ import annotations

import pytest
from dcp_direct_harness import run_ranks
from ranks import free_port, gpu_ranks

SIZES = [2, 4, 5, 40, 64]  # decode sizing: capacity 4; max_num_batched_tokens = 64
TOL = 0.02  # bf16 partials, output rounded to bf16


@pytest.fixture(scope="module")
def decode_sized(tmp_path_factory):
    return [r["decode"] for r in run_ranks(tmp_path_factory.mktemp("a2a"), SIZES)]


@pytest.mark.parametrize("size", SIZES)
def test_combine_matches_reference_above_capacity(decode_sized, size):
    for res in decode_sized:
        assert res["capacity"] == 4
        rec = res["scenarios"][str(size)]
        assert "a2a_error" not in rec, rec["a2a_error"]
        assert rec["a2a_err"] <= TOL * max(1.0, rec["a2a_ref_max"])
        calls = rec["calls"]
        expected = (1, 0) if size <= 4 else (0, 1)
        assert (calls["direct_a2a"], calls["nccl_a2a"]) == expected


@pytest.mark.gpu
def test_gpu_direct_a2a_capacity_and_transports(tmp_path):
    """``OVERLAY_DCP_RANKS`` GPUs (default 2), vLLM's own direct A2A kernel over symmetric memory
    (multicast off); TP = DCP = ranks, 16 heads per rank.

    0.28.0's combine (the workspace's ``lse_reduce``) raises the capacity error at capacity + 1;
    the patched combine returns the float64 reference there and at prefill size; ag_rs, NCCL
    a2a and direct a2a agree with the reference on mixed and pure-prefill batches. Timings
    (direct vs NCCL fallback) go to the report named by ``DCP_A2A_GPU_REPORT``.
    """
    import json
    import os

    import torch.multiprocessing as mp
    from dcp_direct_harness import gpu_worker

    world = gpu_ranks()
    # gpu_worker writes the model's config.json (world * 16 heads) into the directory.
    mp.spawn(gpu_worker, args=(world, free_port(), str(tmp_path / "model"), str(tmp_path / "report")),
             nprocs=world)
    reports = [json.loads((tmp_path / f"report.rank{r}.json").read_text()) for r in range(world)]
    if os.environ.get("DCP_A2A_GPU_REPORT"):
        with open(os.environ["DCP_A2A_GPU_REPORT"], "w") as f:
            json.dump(reports, f, indent=1)
    for rep in reports:
        cap = rep["capacity"]["decode"]
        for row in rep["checks"]:
            if row["check"] == "unpatched_direct" and row["tokens"] == cap + 1:
                assert "exceeds symmetric buffer capacity" in row.get("error", ""), row
            else:
                assert "error" not in row, row
                assert row["max_err"] <= TOL * max(1.0, row["ref_max"]), row
