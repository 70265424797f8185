"""dcp-forced-mqa-prefill-rows: the DCP combine covers every row of a forced-MQA batch.

Sparse MLA with DCP sends prefill rows through the MQA kernel (no dense-MHA prefill backend,
or a prefill longer than ``index_topk``). On 0.28.0 the combine is then given the decode-only
``seq_lens`` / ``query_start_loc``: the NCCL transports mask every prefill row's LSE to -inf
(silently wrong rows), and a pure-prefill batch (no decode bounds at all) is refused by the direct
A2A kernel. Mixed batches are right on the direct kernel by accident (``kernel_contracts``: a row past
the last boundary is the last sequence's) unless the last decode request holds no KV on this rank:
then its prefill rows lose this rank's partial (``mixed_empty_last_decode``). Judged by the output
alone, on the release plus the patches before this one: the NCCL cases and those direct ones fail,
the other direct ones pass both ways. Mixed, pure-prefill and FlashMLA-sparse MTP batches.

Which requests still take the forced path with MTP: under DCP with interleave 1 FlashMLA-sparse
keeps (1 + k)-token MTP rows as decodes (``supports_dcp_with_varlen``), so an MTP step reaches
the forced path through the prefill beside it (a chunk longer than the decode threshold, beyond
``index_topk``): ``flashmla_mtp_mixed``. With interleave > 1 the builder's threshold drops to 1
and the MTP rows themselves become forced-MQA prefills: ``flashmla_mtp_interleave16``.
"""

from __future__ import annotations

import compat
import pytest
import sparse_dcp_harness as h
import torch

BATCHES = {
    # name: (metadata module, class, query_lens, seq_lens, decode threshold, expected decodes,
    #        cp_kv_cache_interleave_size)
    "mixed": ("flashinfer_mla_sparse", "FlashInferMLASparseMetadata", [1, 1, 20], [90, 5, 40], 1, 2, 1),
    "pure_prefill": ("flashinfer_mla_sparse", "FlashInferMLASparseMetadata", [12, 30], [12, 300], 1, 0, 1),
    "flashmla_mtp_mixed": ("flashmla_sparse", "FlashMLASparseMetadata", [3, 3, 3, 40], [70, 9, 130, 40], 3, 3,
                           1),
    "flashmla_mtp_interleave16": ("flashmla_sparse", "FlashMLASparseMetadata", [3, 3, 3], [70, 9, 130], 3, 0,
                                  16),
    "flashmla_mixed": ("flashmla_sparse", "FlashMLASparseMetadata", [1, 1, 1, 17], [3, 66, 2, 17], 1, 3, 1),
    # the last decode request holds no KV on this rank: a prefill row the bounds leave out is the last
    # sequence's to the direct kernel (its binary search), so it loses this rank's partial
    "mixed_empty_last_decode": ("flashinfer_mla_sparse", "FlashInferMLASparseMetadata", [1, 1, 20], [90, 0, 40],
                                1, 2, 1),
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5")
    return {il: h.make_vllm_config(root / f"il{il}", interleave=il) for il in (1, 16)}


@pytest.mark.parametrize("transport", ["nccl", "direct"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_forced_mqa_rows_are_combined(configs, batch, transport):
    module, cls_name, query_lens, seq_lens, threshold, num_decodes, interleave = BATCHES[batch]
    vllm_config = configs[interleave]
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
    lse = produced["lse"].clone()  # a request with no KV on this rank: its rows get none of this rank's partial
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    for r, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            lse[starts[r]:starts[r + 1]] = float("-inf")
    expected = h.expected_rows(layer, rec, produced["out"], lse)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)  # base: prefill rows wrong
