"""dcp-mla-combine-v-up-proj-helper: one ``MLAAttention._dcp_combine_v_up_proj`` merges the DCP partials and
projects them through W_UV, for ``MLAAttention.forward_impl`` and DeepseekV32Attention's sparse path alike.

- GLM-5's attention class from the release's registry on two gloo ranks against one
  (``glm5_path``): every sparse step hands its partials to the helper once, over ag_rs (latent merge,
  then W_UV) and NCCL a2a (``v_up_proj_combine``), and equals DCP 1;
- the real ``forward_impl`` (``sparse_dcp_harness``: rank 0 of DCP 2, the peer simulated) hands its
  decode partials to the same helper, which writes the merged, projected rows.
"""

from __future__ import annotations

import compat
import glm5_path as g
import glm5_projection as gp
import pytest
import sparse_dcp_harness as h
import torch

RUNS = [("ag_rs", "auto"), ("nccl_a2a", "auto")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> gp.Ranks:
    return gp.run_both(tmp_path_factory, RUNS)


@pytest.mark.parametrize("case", list(g.CASES))
@pytest.mark.parametrize(("transport", "value"), RUNS, ids=[t for t, _ in RUNS])
def test_sparse_path_merges_through_the_layer_helper(ranks, transport: str, value: str, case: str) -> None:
    reps = ranks.reports
    assert gp.layer_merges(gp.result(reps, transport, value, case)) == [1, 1]
    gp.assert_equals_dcp1(ranks, transport, value, case)


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory):
    return h.make_vllm_config(tmp_path_factory.mktemp("glm5"))


@pytest.mark.parametrize(("query_lens", "seq_lens", "threshold"), [([1, 1, 1], [90, 5, 40], 1), ([3, 3], [70, 130], 3)],
                         ids=["decode", "mtp"])
def test_forward_impl_merges_through_the_layer_helper(vllm_config, query_lens: list[int], seq_lens: list[int],
                                                      threshold: int) -> None:
    rec = h.Recorder()
    layer = h.make_layer(vllm_config, f"layers.helper.{len(query_lens)}.attn", rec)
    helper = compat.added(layer, "_dcp_combine_v_up_proj")
    calls: list[tuple[int, ...]] = []

    def spy(attn_out, lse, out, **kwargs):
        calls.append(tuple(attn_out.shape))
        return helper(attn_out, lse, out, **kwargs)

    layer._dcp_combine_v_up_proj = spy
    md = h.build_metadata(vllm_config, layer.layer_name,
                          compat.symbol("flashinfer_mla_sparse", "FlashInferMLASparseMetadata"), query_lens, seq_lens,
                          threshold)
    out, produced = h.run_forward(layer, md, sum(query_lens))
    assert calls == [(sum(query_lens), 2 * h.NUM_HEADS, h.LORA)]
    torch.testing.assert_close(out, h.expected_rows(layer, rec, produced["out"], produced["lse"]),
                               rtol=1e-4, atol=1e-4)
