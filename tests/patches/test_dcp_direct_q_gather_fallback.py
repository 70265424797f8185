"""dcp-direct-q-gather-fallback: above capacity the query gather takes the NCCL all-gather.

The direct (symmetric-memory) q-gather workspace holds ``get_dcp_workspace_max_num_tokens``
tokens, sized for decode traffic; a forced-MQA batch with prefill rows overflows it (on 0.28.0:
``as_strided`` out of bounds on the CPU here, the kernel's capacity error on a GPU). Two real
gloo ranks, the real ``MLADCPManager``; decode-only (2 rows), at capacity, capacity + 1 and a
prefill-sized batch. Multicast is never enabled: only the path selection runs here.
"""

from __future__ import annotations

import pytest
from dcp_direct_harness import run_ranks

SIZES = [2, 4, 5, 40]  # capacity is 4 (max_num_seqs=4, no speculation)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return [r["decode"] for r in run_ranks(tmp_path_factory.mktemp("qgather"), SIZES,
                                           modes={"decode": {}})]


def test_capacity_is_decode_sized(results):
    assert [r["capacity"] for r in results] == [4, 4]


@pytest.mark.parametrize("size", SIZES)
def test_query_gather_exact_on_both_ranks(results, size):
    for res in results:
        rec = res["scenarios"][str(size)]
        assert "q_error" not in rec, rec["q_error"]
        assert rec["q_err"] == 0.0


@pytest.mark.parametrize("size", SIZES)
def test_direct_up_to_capacity_nccl_above(results, size):
    for res in results:
        calls = res["scenarios"][str(size)]["calls"]
        if size <= 4:
            assert (calls["direct_q_gather"], calls["nccl_all_gather"]) == (1, 0)
        else:
            assert (calls["direct_q_gather"], calls["nccl_all_gather"]) == (0, 1)
