"""flashmla-sparse-dcp-spec-cudagraphs: no full CUDA graphs of multi-token prefills under DCP.

Under DCP with ``cp_kv_cache_interleave_size`` 1, FlashMLA-sparse keeps uniform (1 + k)-token
MTP steps as decodes (flashmla-sparse-dcp declares ``supports_dcp_with_varlen``), so they are
captured in FULL decode graphs like every other decode: the builder reports ``UNIFORM_BATCH``
and vLLM keeps ``FULL_AND_PIECEWISE`` with MTP-5. With interleave > 1 the reorder threshold is
1, a uniform MTP batch is built as prefills, and capturing those paths killed the engine on two
H200s ("operation not permitted when stream is capturing" in the dense prefill's NCCL KV
all-gather): there the builder must report single-token decodes only, so that vLLM resolves the
mode to PIECEWISE with spec decoding and keeps FULL decode graphs without it. Without DCP
nothing changes.
"""

from __future__ import annotations

import compat
import pytest
import sparse_dcp_harness as h

# (DCP size, cp_kv_cache_interleave_size) of each configuration below
LAYOUTS = [(1, 1), (2, 1), (2, 16)]


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5")
    return {(dcp, il): h.make_vllm_config(root / f"dcp{dcp}-il{il}", dcp=dcp, interleave=il)
            for dcp, il in LAYOUTS}


def _builder():
    return compat.symbol("flashmla_sparse", "FlashMLASparseMetadataBuilder")


def _spec():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=h.BLOCK, num_kv_heads=1, head_size=656, dtype=__import__("torch").uint8,
                            cache_dtype_str="fp8_ds_mla")


def _support(vllm_config):
    return _builder().get_cudagraph_support(vllm_config, _spec())


def _resolve(support, uniform_decode_query_len: int):
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    # the engine's default: piecewise compilation split at the attention ops, FULL_AND_PIECEWISE
    cc = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, cudagraph_capture_sizes=[1, 2, 4, 8, 16],
                           max_cudagraph_capture_size=16, splitting_ops=list(CompilationConfig._attention_ops))
    assert cc.splitting_ops_contain_attention()
    return cc.resolve_cudagraph_mode_and_sizes(support, "FlashMLASparseBackend", uniform_decode_query_len)


@pytest.mark.parametrize(("layout", "decodes"), [((1, 1), True), ((2, 1), True), ((2, 16), False)])
def test_mtp_steps_stay_decodes_only_where_the_builder_keeps_them(configs, layout, decodes, monkeypatch):
    """The premise of the support levels below, read from the builder itself: its reorder threshold
    stays above 1 under DCP only with interleave 1. A release whose builder keeps (1 + k)-token
    steps as decodes at interleave 16 wants them in full graphs, and this patch would demote them to
    PIECEWISE: there the patch is contradicted, and the rebase leaves it to a person."""
    dcp, interleave = layout
    name = f"layers.premise.{dcp}.{interleave}.attn"
    with compat.setup("a sparse MLA layer for the FlashMLA-sparse builder"):
        h.no_pinned_memory(monkeypatch.setattr)  # page-locking needs CUDA
        monkeypatch.setattr(compat.module("flashmla_sparse"), "torch", h.UnpinnedTorch())  # 0.29.0+
        h.make_layer(configs[layout], name, h.Recorder())  # the builder looks its layer up
    metadata_cls = compat.symbol("flashmla_sparse", "FlashMLASparseMetadata")
    kept = h.keeps_dcp_varlen_decodes(configs[layout], name, metadata_cls, _spec())
    assert kept == decodes, (
        f"DCP {dcp}, interleave {interleave}: the builder "
        + ("keeps" if kept else "does not keep")
        + " multi-token steps as decodes; the full-graph support below assumes the opposite")


@pytest.mark.parametrize(("layout", "support"), [
    ((1, 1), "UNIFORM_BATCH"),
    ((2, 1), "UNIFORM_BATCH"),                  # MTP steps are decodes: full graphs of them
    ((2, 16), "UNIFORM_SINGLE_TOKEN_DECODE"),   # MTP steps are prefills: never captured
])
def test_cudagraph_support(configs, layout, support):
    assert _support(configs[layout]).name == support


@pytest.mark.parametrize(("layout", "query_len", "mode"), [
    ((2, 1), 6, "FULL_AND_PIECEWISE"),   # MTP-5 under DCP: verification in FULL decode graphs
    ((2, 16), 6, "PIECEWISE"),           # MTP-5 under DCP, interleave 16: verification piecewise
    ((2, 16), 1, "FULL_AND_PIECEWISE"),  # plain decode under DCP keeps its full graphs
    ((1, 1), 6, "FULL_AND_PIECEWISE"),   # MTP-5 without DCP: unchanged
])
def test_resolved_cudagraph_mode(configs, layout, query_len, mode):
    assert _resolve(_support(configs[layout]), query_len).name == mode
