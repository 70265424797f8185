"""flashmla-sparse-dcp-spec-cudagraphs: no full CUDA graphs of multi-token decodes under DCP.

On 0.28.0 (with flashmla-sparse-dcp) ``FlashMLASparseMetadataBuilder`` reports
``UNIFORM_BATCH`` although under DCP its reorder threshold is 1, so a uniform MTP batch
(1 + k tokens per request) is built as prefills. With speculative decoding vLLM then
keeps FULL decode graphs and captures those prefill paths: the engine died at start-up on
two H200s (TP2 x DCP2, MTP-5: "operation not permitted when stream is capturing" in the
dense prefill's NCCL KV all-gather). The builder must report single-token decodes only
under DCP, so that vLLM resolves the mode to PIECEWISE with spec decoding and keeps FULL
decode graphs without it; without DCP nothing changes.
"""

from __future__ import annotations

import compat
import pytest
import sparse_dcp_harness as h


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5")
    return {dcp: h.make_vllm_config(root / f"dcp{dcp}", dcp=dcp) for dcp in (1, 2)}


def _builder():
    return compat.symbol("flashmla_sparse", "FlashMLASparseMetadataBuilder")


def _support(vllm_config):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=h.BLOCK, num_kv_heads=1, head_size=656, dtype=__import__("torch").uint8,
                            cache_dtype_str="fp8_ds_mla")
    return _builder().get_cudagraph_support(vllm_config, spec)


def _resolve(support, uniform_decode_query_len: int):
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    # the engine's default: piecewise compilation split at the attention ops, FULL_AND_PIECEWISE
    cc = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, cudagraph_capture_sizes=[1, 2, 4, 8, 16],
                           max_cudagraph_capture_size=16, splitting_ops=list(CompilationConfig._attention_ops))
    assert cc.splitting_ops_contain_attention()
    return cc.resolve_cudagraph_mode_and_sizes(support, "FlashMLASparseBackend", uniform_decode_query_len)


def test_dcp_reports_single_token_decodes_only(configs):
    from vllm.v1.attention.backend import AttentionCGSupport

    assert _support(configs[2]) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert _support(configs[1]) == AttentionCGSupport.UNIFORM_BATCH


@pytest.mark.parametrize(("dcp", "query_len", "mode"), [
    (2, 6, "PIECEWISE"),             # MTP-5 under DCP: verification runs piecewise
    (2, 1, "FULL_AND_PIECEWISE"),    # plain decode under DCP keeps its full graphs
    (1, 6, "FULL_AND_PIECEWISE"),    # MTP-5 without DCP: unchanged
])
def test_resolved_cudagraph_mode(configs, dcp, query_len, mode):
    assert _resolve(_support(configs[dcp]), query_len).name == mode
