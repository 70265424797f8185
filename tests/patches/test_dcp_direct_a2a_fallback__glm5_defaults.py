"""dcp-direct-a2a-fallback under the DCP options a GLM-5 user gets from vLLM 0.33.0.

vLLM 0.33.0 resolves DCP for GLM-5 to the a2a combine with query replication when the user names
neither (``GlmMoeDsaForCausalLM.verify_and_update_config``): so a GLM-5 user on 0.33.0 who says
nothing runs the direct A2A workspace (on one node), and never the direct query gather, whose
workspace ``MLADCPManager`` still makes. Checked:

- the A2A workspace, which is used: two real gloo ranks, the config as such a user gets it (the
  release's own resolution where it lets the model choose, a2a spelled out where it does not, as on
  0.28.0): steps up to the decode capacity are combined on the direct path, steps above it take
  NCCL, each matching the float64 reference;
- the query-gather workspace, which is not: under query replication vLLM's real ``forward_impl``
  never calls the query gather (decode and MTP steps), so sizing it larger would buy nothing.
"""

from __future__ import annotations

import pytest
import sparse_dcp_harness as h
from dcp_direct_harness import run_ranks

SIZES = [2, 5, 40, 64]  # decode sizing: capacity 4; max_num_batched_tokens = 64
TOL = 0.02  # bf16 partials, output rounded to bf16


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("a2a-glm5"), SIZES, user_defaults=True, timeout=600)


def test_the_config_is_what_a_glm5_user_gets(reports) -> None:
    for rep in reports:
        resolved = rep["resolved"]
        assert resolved["dcp_comm_backend"] == "a2a", resolved
        if resolved["by_release"]:  # the release chose: 0.33.0 replicates the query for GLM-5
            assert resolved["dcp_q_replicate"] is True, resolved


@pytest.mark.parametrize("size", SIZES)
def test_release_sizing_takes_nccl_above_the_decode_capacity(reports, size: int) -> None:
    for rep in reports:
        res = rep["decode"]
        assert res["capacity"] == 4
        rec = res["scenarios"][str(size)]
        assert "a2a_error" not in rec, rec["a2a_error"]
        assert rec["a2a_err"] <= TOL * max(1.0, rec["a2a_ref_max"])
        assert (rec["calls"]["direct_a2a"], rec["calls"]["nccl_a2a"]) == ((1, 0) if size <= 4 else (0, 1))


@pytest.mark.parametrize("batch", ["decode", "mtp"])
def test_replicated_query_never_reads_the_query_gather(tmp_path_factory, monkeypatch, batch: str) -> None:
    import compat
    import dcp_qrep_harness as qh

    vc = h.make_vllm_config(tmp_path_factory.mktemp("glm5-qgather"))
    name = f"layers.qgather.{batch}.attn"
    layer, seen = qh.make_qrep_layer(vc, name, h.Recorder(), project=False, set_attr=monkeypatch.setattr)
    query_lens, seq_lens = qh.BATCHES[batch]
    md = h.build_metadata(vc, name, compat.symbol("flashinfer_mla_sparse", "FlashInferMLASparseMetadata"),
                          query_lens, [len(range(0, s, h.DCP)) for s in seq_lens], 3 if batch == "mtp" else 1)
    qh.run_qrep_forward(layer, md, batch)
    assert seen["dims"], "the decode step did not reach the combine"
    assert seen["query_gather"] == 0
