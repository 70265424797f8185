"""dcp-project-before-merge under query replication and the a2a combine: vLLM 0.33.0's GLM-5 defaults.

vLLM 0.33.0 serves GLM-5 with ``dcp_comm_backend="a2a"`` and ``dcp_q_replicate=True`` unless the
user sets them (``GlmMoeDsaForCausalLM.verify_and_update_config``, upstream #50382): each rank
computes the query of the whole DCP group's heads and absorbs it through ``W_UK_T_dcp_qrep``
instead of all-gathering it. The patch's projection sits after the decode kernel, where both query
paths meet; what it needs from the replicated path is that ``W_UV_dcp`` holds the heads in the
order of ``W_UK_T_dcp_qrep`` (both are all-gathers of this rank's heads over the DCP group).
Checked here, with attention itself (float64, over each rank's interleaved KV shard) in place of
the decode kernel and a reference computed from the replicated query and every rank's
``kv_b_proj`` over the whole KV (what DCP 1 computes):

- vLLM's real ``process_weights_after_loading`` and ``forward_impl`` under query replication (rank
  0; the other ranks' partials from the same replicated query over their shards; the a2a contract
  as the combine): the patched layer merges ``v_head_dim`` values, never calls the query gather,
  and its output equals the reference; with the switch off the release's own order does too;
- two real gloo ranks: the real all-gather gives ``W_UK_T_dcp_qrep`` and ``W_UV_dcp`` head for
  head from the same rank's ``kv_b_proj``, and project-then-merge over the real ag_rs, NCCL a2a and
  direct a2a combines equals the reference, for decode and MTP steps.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import compat
import dcp_qrep_harness as qh
import pytest
import sparse_dcp_harness as h
import torch

# bf16: the absorbed query, the partials, the projection and the output each round once (~2^-8
# relative each); a head of the wrong rank, a wrong weight or a lost partial is of the order of the
# output itself.
REL_TOL = 3e-2
SCALE = 1 / math.sqrt(h.LORA + h.ROPE)
FORWARD = {  # batch -> (metadata class module, class, decode threshold)
    "decode": ("flashinfer_mla_sparse", "FlashInferMLASparseMetadata", 1),
    "mtp": ("flashinfer_mla_sparse", "FlashInferMLASparseMetadata", 3),
}


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory):
    return h.make_vllm_config(tmp_path_factory.mktemp("glm5-qrep"))


def _forward(vllm_config, batch: str, project: bool, monkeypatch: pytest.MonkeyPatch):
    module, cls_name, threshold = FORWARD[batch]
    name = f"layers.qrep{int(project)}.{batch}.attn"
    layer, seen = qh.make_qrep_layer(vllm_config, name, h.Recorder(), project=project,
                                     set_attr=monkeypatch.setattr)
    query_lens, seq_lens = qh.BATCHES[batch]
    md = h.build_metadata(vllm_config, name, compat.symbol(module, cls_name), query_lens,
                          [len(range(0, s, h.DCP)) for s in seq_lens], threshold)
    out, q_rep, (kv, pe) = qh.run_qrep_forward(layer, md, batch)
    ref = qh.reference(batch, q_rep, kv, pe, 0, h.DCP, h.NUM_HEADS, h.NOPE, h.LORA, h.V, SCALE)
    return layer, seen, out, ref


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    err = float((out.double() - ref).abs().max())
    top = float(ref.abs().max())
    assert err <= REL_TOL * top, f"max error {err:.3g} against a reference of max {top:.3g}"


@pytest.mark.parametrize("batch", list(FORWARD))
def test_replicated_query_decode_projects_before_merge_and_is_exact(vllm_config, batch: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    layer, seen, out, ref = _forward(vllm_config, batch, project=True, monkeypatch=monkeypatch)
    assert layer.W_UK_T_dcp_qrep is not None and layer.W_UK_T_dcp_qrep.shape[0] == h.DCP * h.NUM_HEADS
    w_uv_dcp = compat.added(layer, "W_UV_dcp")  # gathered at weight processing, as W_UK_T_dcp_qrep is
    assert w_uv_dcp is not None and tuple(w_uv_dcp.shape) == (h.DCP * h.NUM_HEADS, h.LORA, h.V)
    assert seen["gathered"] == ["W_UK_T", "W_UV"], seen["gathered"]
    assert seen["query_gather"] == 0, "query replication must not gather the query"
    assert seen["dims"] == [h.V], f"the merge must carry v_head_dim ({h.V}) values, got {seen['dims']}"
    _close(out, ref)


@pytest.mark.parametrize("batch", list(FORWARD))
def test_replicated_query_decode_switch_off_keeps_the_release_order(vllm_config, batch: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _, seen, out, ref = _forward(vllm_config, batch, project=False, monkeypatch=monkeypatch)
    assert seen["gathered"] == ["W_UK_T"] and seen["query_gather"] == 0
    assert seen["dims"] == [h.LORA]  # merged in latent space, then _v_up_proj
    _close(out, ref)


@pytest.fixture(scope="module")
def rank_reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return qh.run_ranks(tmp_path_factory.mktemp("qrep-ranks"))


def test_two_ranks_gather_the_weights_in_one_head_order(rank_reports) -> None:
    for rep in rank_reports:
        assert rep["W_UK_T_dcp_qrep_err"] == 0.0, rep
        assert rep["W_UV_dcp_err"] == 0.0, rep  # head h of W_UV_dcp is head h of W_UK_T_dcp_qrep


@pytest.mark.parametrize("batch", list(qh.BATCHES))
@pytest.mark.parametrize("transport", ["nccl_a2a", "direct_a2a", "ag_rs"])
def test_two_ranks_replicated_query_project_then_merge_is_exact(rank_reports, transport: str, batch: str) -> None:
    for rep in rank_reports:
        (row,) = [r for r in rep["checks"] if r["transport"] == transport and r["batch"] == batch]
        if row.get("error_kind") == "harness":
            raise compat.HarnessError(row["error"])
        assert "error" not in row, row["error"]
        assert row["baseline_err"] <= REL_TOL * row["ref_max"], row  # the release's order holds too
        assert row["projected_err"] <= REL_TOL * row["ref_max"], row


def test_reference_sees_a_wrong_head_order(tmp_path: Path) -> None:
    """The check can fail: the same replicated query absorbed with the group's heads in the wrong
    rank order misses the reference by far more than the tolerance."""
    batch, heads, nope, lora, v = "decode", 4, 16, 64, 32
    q_rep = qh.replicated_query(batch, 2 * heads, nope, qh.ROPE)
    kv, pe = qh.kv_cache(batch, lora, qh.ROPE)
    scale = 1 / math.sqrt(lora + qh.ROPE)
    ref = qh.reference(batch, q_rep, kv, pe, 0, 2, heads, nope, lora, v, scale)
    swapped = torch.cat([q_rep[:, heads:], q_rep[:, :heads]], dim=1)
    wrong = qh.reference(batch, swapped, kv, pe, 0, 2, heads, nope, lora, v, scale)
    assert float((wrong - ref).abs().max()) > 10 * REL_TOL * float(ref.abs().max())
