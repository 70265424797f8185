"""What a release's tree cannot say of itself, with the evidence beside each entry: which attention
class a model class's decoder layer builds for GLM-5 and where the model enters its DCP section.

Keyed by the model class GLM-5's registry line resolves to on CUDA (``derive.model_class``), so a
release that moves GLM-5 to a class not listed here is refused, naming that class. Each entry is checked
against the tree it describes (the class and the entry's method must be defined where it says).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Attention:
    """The attention a model class builds and how GLM-5's step enters its DCP section."""

    module: str  # the attention class's module
    cls: str
    entry: str  # "forward_impl" | "sparse_indexer_and_attn" (the GLM-5 path harness's names)
    defined: tuple[str, str, str]  # (module, class, method) the entry runs: checked in the tree
    evidence: str


ATTENTION: dict[str, Attention] = {
    "vllm.model_executor.models.deepseek_v2.GlmMoeDsaForCausalLM": Attention(
        "vllm.model_executor.models.deepseek_v2", "DeepseekV2MLAAttention", "forward_impl",
        ("vllm.model_executor.layers.attention.mla_attention", "MLAAttention", "forward_impl"),
        "0.28.0: GlmMoeDsaForCausalLM(DeepseekV2ForCausalLM); DeepseekV2DecoderLayer takes "
        "attn_cls = DeepseekV2MLAAttention when model_config.use_mla, whose mla_attn wrapper calls "
        "MLAAttention.forward_impl, where the DCP combine and W_UV are (tests/patches/glm5_path.py builds it)"),
    "vllm.models.deepseek_v32.nvidia.model.DeepseekV32ForCausalLM": Attention(
        "vllm.models.deepseek_v32.attention", "DeepseekV32Attention", "sparse_indexer_and_attn",
        ("vllm.models.deepseek_v32.attention", "DeepseekV32Attention", "_sparse_indexer_and_attn"),
        "0.29.0 on (read in 0.33.0 and 0.34.0): nvidia/model.py's decoder layer builds "
        "self.self_attn = DeepseekV32Attention(...), an MLAAttention whose _sparse_indexer_and_attn runs the "
        "indexer, the query gather, forward_mqa, the DCP combine and W_UV itself"),
}
