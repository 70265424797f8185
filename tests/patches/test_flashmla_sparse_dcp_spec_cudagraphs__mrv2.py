"""flashmla-sparse-dcp-spec-cudagraphs on Model Runner V2, vLLM 0.33.0's default runner (0.34.0's only one).

Both runners ask the builder for its CUDA-graph support (V1: ``builder_cls.get_cudagraph_support``
in ``gpu_model_runner.py``; V2: the attention groups' builders in ``worker/gpu/attn_utils.py``) and
resolve the mode with ``CompilationConfig.resolve_cudagraph_mode_and_sizes``; V2 passes
``use_v2_model_runner=True`` and the verification length ``1 + k`` (``decode_query_len``). Under
0.33.0's defaults (``cp_kv_cache_interleave_size`` 1) the patch changes nothing: MTP steps are
decodes in FULL graphs. With DCP and interleave > 1 the V2 resolution must fall back to PIECEWISE
with spec decoding as V1's does, and keep FULL decode graphs without it.
"""

from __future__ import annotations

import inspect

import pytest
import sparse_dcp_harness as h
import test_flashmla_sparse_dcp_spec_cudagraphs as v1


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5-mrv2")
    return {(dcp, il): h.make_vllm_config(root / f"dcp{dcp}-il{il}", dcp=dcp, interleave=il)
            for dcp, il in v1.LAYOUTS}


def _resolve_v2(support, decode_query_len: int):
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    cc = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, cudagraph_capture_sizes=[1, 2, 4, 8, 16],
                           max_cudagraph_capture_size=16, splitting_ops=list(CompilationConfig._attention_ops))
    # 0.33.0 tells the resolution which runner asks; 0.34.0 has only V2 and no such argument
    v2 = ({"use_v2_model_runner": True}
          if "use_v2_model_runner" in inspect.signature(cc.resolve_cudagraph_mode_and_sizes).parameters else {})
    return cc.resolve_cudagraph_mode_and_sizes(support, "FlashMLASparseBackend", decode_query_len, **v2)


@pytest.mark.parametrize(("layout", "query_len", "mode"), [
    ((2, 1), 6, "FULL_AND_PIECEWISE"),   # 0.33.0's default interleave: MTP-5 verification in FULL graphs
    ((2, 16), 6, "PIECEWISE"),           # interleave 16: the (1 + k)-token steps are prefills, never captured
    ((2, 16), 1, "FULL_AND_PIECEWISE"),  # plain decode keeps its full graphs
    ((1, 1), 6, "FULL_AND_PIECEWISE"),   # no DCP: unchanged
])
def test_v2_resolved_cudagraph_mode(configs, layout, query_len, mode):
    builder = v1._builder()
    # V2 asks a builder instance (group.get_metadata_builder(0)); the support is the class's
    support = builder.get_cudagraph_support(configs[layout], v1._spec())
    assert _resolve_v2(support, query_len).name == mode
