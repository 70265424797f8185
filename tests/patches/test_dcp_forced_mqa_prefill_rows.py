"""dcp-forced-mqa-prefill-rows: the DCP combine covers every row of a forced-MQA batch.

Sparse MLA with DCP sends prefill rows through the MQA kernel (no dense-MHA prefill backend,
or a prefill longer than ``index_topk``). On 0.28.0 the combine is then given the decode-only
``seq_lens`` / ``query_start_loc``: the NCCL transports mask every prefill row's LSE to -inf
(silently wrong rows), a pure-prefill batch crashes, and the direct A2A kernel's bounds do not
cover the batch. Mixed, pure-prefill and FlashMLA-sparse MTP batches (under DCP its builder
has no varlen decodes, so 3-token MTP rows take the forced path), both transport contracts.
"""

from __future__ import annotations

import compat
import pytest
import sparse_dcp_harness as h
import torch

BATCHES = {
    # name: (metadata module, class, query_lens, seq_lens, decode threshold, expected decodes)
    "mixed": ("flashinfer_mla_sparse", "FlashInferMLASparseMetadata", [1, 1, 20], [90, 5, 40], 1, 2),
    "pure_prefill": ("flashinfer_mla_sparse", "FlashInferMLASparseMetadata", [12, 30], [12, 300], 1, 0),
    "flashmla_mtp": ("flashmla_sparse", "FlashMLASparseMetadata", [3, 3, 3], [70, 9, 130], 3, 0),
    "flashmla_mixed": ("flashmla_sparse", "FlashMLASparseMetadata", [1, 1, 1, 17], [3, 66, 2, 17], 1, 3),
}


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    return h.make_vllm_config(tmp_path_factory.mktemp("glm5"))


@pytest.mark.parametrize("transport", ["nccl", "direct"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_forced_mqa_rows_are_combined(vllm_config, batch, transport):
    module, cls_name, query_lens, seq_lens, threshold, num_decodes = BATCHES[batch]
    name = f"layers.{batch}.{transport}.attn"
    rec = h.Recorder()
    layer = h.make_layer(vllm_config, name, rec, transport=transport)
    md = h.build_metadata(vllm_config, name, compat.symbol(module, cls_name), query_lens, seq_lens,
                          threshold)
    assert md.num_decodes == num_decodes and md.num_decodes + md.num_prefills == len(query_lens)
    num_tokens = sum(query_lens)
    out, produced = h.run_forward(layer, md, num_tokens)
    (call,) = rec.combine_calls
    assert int(call["rows"]) == num_tokens  # the forced path: every row went through MQA
    expected = h.expected_rows(layer, rec, produced["out"], produced["lse"])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)  # base: prefill rows wrong
    assert call["seq_lens"].tolist() == seq_lens
    assert call["query_start_loc"].tolist() == [0, *torch.tensor(query_lens).cumsum(0).tolist()]
