"""sparse-mla-decode-metadata-guard: the DCP branch of forward_impl reads sparse metadata.

On 0.28.0 ``MLAAttention.forward_impl`` reads ``attn_metadata.decode`` after the MQA kernel;
the sparse metadata classes do not derive from ``MLACommonMetadata`` and have no ``decode``,
so every DCP step of a sparse model raises ``AttributeError``. Both classes come from vLLM's
own sparse builder; decode-only batches (plain and MTP-style 3-token decodes).
"""

from __future__ import annotations

import compat
import pytest
import sparse_dcp_harness as h
import torch


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    return h.make_vllm_config(tmp_path_factory.mktemp("glm5"))


def _metadata_classes():
    return [compat.symbol("flashinfer_mla_sparse", "FlashInferMLASparseMetadata"),
            compat.symbol("flashmla_sparse", "FlashMLASparseMetadata")]


@pytest.mark.parametrize(("cls_index", "query_len"), [(0, 1), (0, 3), (1, 1)],
                         ids=["flashinfer_sparse-decode", "flashinfer_sparse-mtp_decode",
                              "flashmla_sparse-decode"])
def test_decode_only_batch_combines_with_sparse_seq_lens(vllm_config, cls_index, query_len):
    metadata_cls = _metadata_classes()[cls_index]
    name = f"layers.{cls_index}.{query_len}.attn"
    rec = h.Recorder()
    layer = h.make_layer(vllm_config, name, rec)
    seq_lens = [130, 7, 64, 1000]
    md = h.build_metadata(vllm_config, name, metadata_cls, [query_len] * 4, seq_lens, query_len)
    assert isinstance(md, metadata_cls)
    assert md.num_decodes == 4 and md.num_prefills == 0
    out, produced = h.run_forward(layer, md, 4 * query_len)
    (call,) = rec.combine_calls
    assert call["seq_lens"].tolist() == seq_lens
    assert call["query_start_loc"].tolist() == [query_len * i for i in range(5)]
    torch.testing.assert_close(out, h.expected_rows(layer, rec, produced["out"], produced["lse"]),
                               rtol=1e-4, atol=1e-4)
