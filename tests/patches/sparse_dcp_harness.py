"""CPU harness for the sparse-MLA DCP patch tests (issue 4): real configs, real metadata.

Builds a ``VllmConfig`` from a local GLM-5 ``config.json`` (``GlmMoeDsaForCausalLM``, no hub),
real sparse metadata (``FlashInferMLASparseMetadata`` / ``FlashMLASparseMetadata``) from
vLLM's own ``SparseMLACommonMetadataBuilder.build``, and an ``MLAAttention`` whose real
``forward_impl`` runs the DCP branch. Only GPU-only pieces are replaced, at their call
boundary: the backend's ``forward_mqa`` kernel, and the DCP query all-gather / output combine
collectives of a DCP group of ``dcp`` ranks (default 2; rank 0 here, the other ranks' partial
results simulated).

The combine stand-in does what every transport does with the arguments it is given: the NCCL
paths mask the LSE with vLLM's real ``mask_dcp_empty_shards_``; the direct A2A kernel makes its
argument checks and gives zero weight to rows of empty sequences as it finds them
(``kernel_contracts``, held to the compiled op). The merge itself is vLLM's float reference
``_lse_weighted_combine``.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import compat
import torch

NUM_HEADS = 4  # heads per TP rank
NOPE, ROPE, LORA, V = 8, 4, 16, 8
DCP = 2  # the default DCP size (TP = DCP); every builder below takes ``dcp`` for other sizes
BLOCK = 64

# vLLM inspects model classes in a subprocess (``python -m vllm.model_executor.models.registry``):
# that process must import the same tree as this one, not the installed wheel.
if os.environ.get("OVERLAY_VLLM_TREE") and os.environ["OVERLAY_VLLM_TREE"] not in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.environ["OVERLAY_VLLM_TREE"], os.environ.get("PYTHONPATH")) if p)



GLM5_CONFIG: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
    "hidden_size": 256, "num_attention_heads": NUM_HEADS * DCP, "num_key_value_heads": NUM_HEADS * DCP,
    "num_hidden_layers": 2, "intermediate_size": 512, "moe_intermediate_size": 128,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "kv_lora_rank": LORA, "q_lora_rank": 64, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
    "v_head_dim": V, "index_topk": 16, "index_head_dim": 32, "index_n_heads": 4,
    "vocab_size": 1024, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
    "first_k_dense_replace": 1, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
}


def glm5_config(num_heads: int = NUM_HEADS * DCP) -> dict[str, Any]:
    """The small local GLM-5 ``config.json`` with ``num_heads`` attention heads in all."""
    return {**GLM5_CONFIG, "num_attention_heads": num_heads, "num_key_value_heads": num_heads}


_UNSET = object()


def make_vllm_config(model_dir: Path, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                     device: str = "cpu", dcp: int = DCP, heads_per_rank: int = NUM_HEADS,
                     interleave: int = 1, comm_backend: Any = _UNSET):
    """A real VllmConfig for a small local GLM-5 model with TP = DCP = ``dcp``.

    The model has ``dcp * heads_per_rank`` attention heads, so each TP rank holds
    ``heads_per_rank`` of them; ``interleave`` is ``cp_kv_cache_interleave_size``.
    ``comm_backend``: ``dcp_comm_backend`` (default ``"a2a"`` with DCP, else ``"ag_rs"``); ``None``
    leaves it (and ``dcp_q_replicate``) unset, as a user who names neither does: the release decides
    (0.33.0's GLM-5: a2a with query replication, see :func:`release_sets_model_dcp_defaults`).
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_dir.mkdir(parents=True, exist_ok=True)
    # Every spawned rank writes the same file: write a private copy, then rename it into place,
    # so that no rank reads one another rank is half-way through writing.
    tmp = model_dir / f"config.json.{os.getpid()}"
    tmp.write_text(json.dumps(glm5_config(dcp * heads_per_rank)))
    os.replace(tmp, model_dir / "config.json")
    if comm_backend is _UNSET:
        comm_backend = "a2a" if dcp > 1 else "ag_rs"
    backend = {} if comm_backend is None else {"dcp_comm_backend": comm_backend}
    with compat.setup("the VllmConfig of the test model"):
        model_config = ModelConfig(model=str(model_dir), tokenizer=None, skip_tokenizer_init=True,
                                   dtype="bfloat16", max_model_len=4096)
        return VllmConfig(
            device_config=DeviceConfig(device=device),
            model_config=model_config,
            parallel_config=ParallelConfig(tensor_parallel_size=dcp, decode_context_parallel_size=dcp,
                                           cp_kv_cache_interleave_size=interleave, **backend),
            scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                             max_num_batched_tokens=max_num_batched_tokens,
                                             max_model_len=4096, is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BLOCK),
        )


def release_sets_model_dcp_defaults() -> bool:
    """Whether the vLLM under test lets the model choose the DCP settings a user leaves unset
    (``ParallelConfig.set_dcp_defaults``, which 0.33.0's ``GlmMoeDsaForCausalLM`` calls with
    ``comm_backend="a2a", q_replicate=True``); 0.28.0 has fixed defaults (ag_rs, no replication)."""
    from vllm.config import ParallelConfig

    return hasattr(ParallelConfig, "set_dcp_defaults")


class _TokenToRequestKernel:
    """vLLM's Triton ``_token_request_mapping_kernel[grid](...)`` (0.30.0+) in torch: token ``t`` ->
    the request whose query range holds it (0 past ``num_mapped``)."""

    def __getitem__(self, grid):
        def run(query_start_loc, output, num_reqs, num_mapped, num_tokens, **_launch):
            token = torch.arange(num_tokens, device=query_start_loc.device)
            req = torch.searchsorted(query_start_loc[1:].long(), token, right=True).clamp(max=num_reqs - 1)
            output[:num_tokens] = torch.where(token < num_mapped, req, 0).to(output.dtype)
        return run


def install_cpu_kernels(set_attr: Callable[[Any, str, Any], None] = setattr) -> None:
    """The Triton kernels the metadata builders launch on their way, replaced by torch (CPU has no
    Triton); by release: 0.30.0 maps tokens to requests with ``_token_request_mapping_kernel``
    (0.32.0 through ``compute_token_to_req_indices``), earlier releases on the host. ``set_attr``:
    ``setattr``, or ``monkeypatch.setattr`` to undo it after the test."""
    try:
        import vllm.v1.attention.ops.metadata as ops_metadata
    except ImportError:  # releases before 0.30.0
        return
    if hasattr(ops_metadata, "_token_request_mapping_kernel"):
        set_attr(ops_metadata, "_token_request_mapping_kernel", _TokenToRequestKernel())


# CommonAttentionMetadata fields a test may give that some releases do not have (dropped there)
_OPTIONAL_FIELDS = {"_seq_lens_cpu"}  # 0.32.0 dropped it (seq_lens_cpu_upper_bound serves)


def common_attention_metadata(**fields: Any):
    """vLLM's ``CommonAttentionMetadata`` of ``fields``, less the optional ones this release lacks."""
    import dataclasses

    from vllm.v1.attention.backend import CommonAttentionMetadata

    have = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in fields.items() if k in have or k not in _OPTIONAL_FIELDS})


def process_weights_after_loading(layer: Any, act_dtype: torch.dtype) -> None:
    """vLLM's real ``process_weights_after_loading`` of an MLA layer built without ``__init__``:
    0.28.0-0.33.0 are given the activation dtype, 0.34.0 reads the ``act_dtype`` its ``__init__`` set,
    and whether the DCP manager projects over NCCL a2a by itself (``dcp_manager``: none here unless the
    harness made one, as a layer without DCP has none)."""
    import inspect

    layer.act_dtype = act_dtype
    if "dcp_manager" not in vars(layer) and "dcp_manager" not in getattr(layer, "_modules", {}):
        layer.dcp_manager = None
    if inspect.signature(layer.process_weights_after_loading).parameters:
        layer.process_weights_after_loading(act_dtype)
    else:
        layer.process_weights_after_loading()


def no_pinned_memory(set_attr: Callable[[Any, str, Any], None]) -> None:
    """``PIN_MEMORY`` off (pinned host memory needs an accelerator; no effect on the values) where
    vLLM reads it: ``vllm.utils.torch_utils`` and the modules that bind their own copy (0.30.0+:
    ``sparse_mla_attention``; 0.33.0: ``mla_attention`` too). ``set_attr``: ``setattr``, or
    ``monkeypatch.setattr`` to undo it after the test."""
    import vllm.utils.torch_utils as torch_utils

    set_attr(torch_utils, "PIN_MEMORY", False)
    sparse = importlib.import_module("vllm.model_executor.layers.attention.sparse_mla_attention")
    for mod in (sparse, compat.module("mla_attention")):
        if hasattr(mod, "PIN_MEMORY"):
            set_attr(mod, "PIN_MEMORY", False)


class _OneDevice:
    """``torch.accelerator`` where vLLM asks which device it runs on: device 0 (on CPU there is none
    to ask, and the answer only picks the device whose compute units a stand-in reports)."""

    @staticmethod
    def current_device_index() -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.accelerator, name)


class UnpinnedTorch:
    """``torch`` for a vLLM module that allocates pinned host memory unconditionally (0.29.0+'s
    FlashMLA-sparse builder: ``torch.empty(..., pin_memory=True)``), which needs an accelerator:
    the same allocations, unpinned (no effect on the values); and asks for the current accelerator
    (0.34.0's ``FlashMLASparseImpl.__init__``: ``torch.accelerator.current_device_index()``), device 0.
    Everything else is torch's own."""

    def __getattr__(self, name: str) -> Any:
        if name == "accelerator":
            return _OneDevice()
        value = getattr(torch, name)
        if name in ("empty", "zeros", "ones", "full", "tensor", "arange"):
            def unpinned(*args: Any, **kwargs: Any) -> torch.Tensor:
                kwargs.pop("pin_memory", None)
                return value(*args, **kwargs)
            return unpinned
        return value


@contextmanager
def transport_for_builders(vllm_config) -> Iterator[None]:
    """The DCP comm backend set to ``ag_rs`` while a backend's own metadata builder is made: vLLM
    0.29.0-0.32.0's FlashMLA-sparse builder refuses DCP with ``a2a``. Its reorder threshold, the
    setting read here, does not depend on the transport (the combine is a stand-in anyway)."""
    parallel = vllm_config.parallel_config
    saved = parallel.dcp_comm_backend
    parallel.dcp_comm_backend = "ag_rs"
    try:
        yield
    finally:
        parallel.dcp_comm_backend = saved


def build_metadata(vllm_config, layer_name: str, metadata_cls: type, query_lens: list[int],
                   seq_lens: list[int], decode_threshold: int):
    """Sparse metadata of ``metadata_cls`` from vLLM's own sparse builder for one batch.

    ``decode_threshold`` is the batch's split point; whether it survives DCP is the real
    builder's own setting (``supports_dcp_with_varlen``, read by :func:`keeps_dcp_varlen_decodes`):
    where the backend keeps multi-token decodes under DCP they stay decodes, elsewhere the
    threshold drops to 1 and they become prefills (the forced-MQA path).
    """
    with compat.setup(f"building {metadata_cls.__name__} with vLLM's sparse builder"):
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        sparse = importlib.import_module("vllm.model_executor.layers.attention.sparse_mla_attention")
        builder_cls = type("Builder", (sparse.SparseMLACommonMetadataBuilder,), {"metadata_cls": metadata_cls})
        spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LORA + ROPE, dtype=torch.bfloat16)
        no_pinned_memory(setattr)
        install_cpu_kernels()
        builder = builder_cls(spec, [layer_name], vllm_config, torch.device("cpu"))
        builder._init_reorder_batch_threshold(
            decode_threshold,
            supports_dcp_with_varlen=keeps_dcp_varlen_decodes(vllm_config, layer_name, metadata_cls, spec))
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        sl = torch.tensor(seq_lens, dtype=torch.int32)
        blocks = max(math.ceil(s / BLOCK) for s in seq_lens)
        common = common_attention_metadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=sl,
            num_reqs=len(query_lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_table_tensor=torch.arange(len(query_lens) * blocks, dtype=torch.int32).view(-1, blocks),
            slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
            seq_lens_cpu_upper_bound=sl.clone(),
        )
        return builder.build(0, common)


def keeps_dcp_varlen_decodes(vllm_config, layer_name: str, metadata_cls: type, spec) -> bool:
    """Whether the real builder of ``metadata_cls``'s backend keeps multi-token decodes under DCP.

    Builds that backend's own metadata builder (``FlashMLASparseMetadata`` ->
    ``FlashMLASparseMetadataBuilder``) for ``vllm_config`` and reads its reorder threshold: under
    DCP it stays above 1 only where the builder declares ``supports_dcp_with_varlen``. Without
    DCP the flag changes nothing (True).
    """
    if vllm_config.parallel_config.decode_context_parallel_size <= 1:
        return True
    module = __import__(metadata_cls.__module__, fromlist=["_"])
    real_cls = getattr(module, metadata_cls.__name__ + "Builder")
    saved = getattr(module, "num_compute_units", None)
    if saved is not None:  # FlashMLA sizes its scheduler buffers by the GPU's SM count
        module.num_compute_units = lambda index=None: 132
    try:
        with transport_for_builders(vllm_config):
            real = real_cls(spec, [layer_name], vllm_config, torch.device("cpu"))
    finally:
        if saved is not None:
            module.num_compute_units = saved
    return (real.reorder_batch_threshold or 1) > 1


@dataclass
class Recorder:
    """What the DCP collectives were given, and the other ranks' simulated partial results.

    ``peer_outs[i]`` / ``peer_lses[i]`` are rank ``i + 1``'s partials (``dcp - 1`` of each).
    """

    combine_calls: list[dict[str, torch.Tensor]] = field(default_factory=list)
    peer_outs: list[torch.Tensor] = field(default_factory=list)
    peer_lses: list[torch.Tensor] = field(default_factory=list)


def _direct_mask(partial_output: torch.Tensor, lse: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, dcp: int) -> None:
    """What the direct A2A kernel does with the bounds it is given (``kernel_contracts``, held to the
    compiled op on one H200): its argument checks, then a zero weight for the rows whose sequence (the
    kernel's binary search of ``query_start_loc``; rows past the last boundary belong to the last
    sequence) has no KV here. Nothing is refused for rows the bounds do not cover: the kernel has no
    such check."""
    import kernel_contracts as kc

    num_tokens, heads, dim = partial_output.shape
    combined = torch.empty(num_tokens, heads // dcp, dim, dtype=torch.bfloat16)
    kc.check_a2a_arguments(compat.vllm_version(), partial_output.to(torch.bfloat16), lse, seq_lens,
                           query_start_loc, combined, dcp, 0, max(num_tokens, 1))
    lse[kc.empty_kv_rows(num_tokens, seq_lens, query_start_loc)] = float("-inf")


def make_layer(vllm_config, layer_name: str, recorder: Recorder, seed: int = 0,
               transport: str = "nccl", dcp: int = DCP):
    """An MLAAttention (sparse, DCP = ``dcp``, this is rank 0) running vLLM's real ``forward_impl``.

    ``transport`` picks the combine's contract: ``"nccl"`` (ag_rs / NCCL a2a: mask the LSE by
    the given bounds) or ``"direct"`` (the direct A2A kernel: its argument checks and its own
    row-to-sequence mapping, ``kernel_contracts``).

    Built without ``__init__`` (that needs a TP group and CUDA kernels); it carries exactly
    the state ``forward_impl`` reads. The backend kernel and the DCP collectives are stand-ins.
    """
    from vllm.config import set_current_vllm_config

    mla = compat.module("mla_attention")
    fi = compat.module("flashinfer_mla_sparse")
    dcp_mod = compat.module("dcp")
    a2a = compat.module("dcp_alltoall")
    common = compat.module("ops_common")
    gen = torch.Generator().manual_seed(seed)

    layer = mla.MLAAttention.__new__(mla.MLAAttention)
    torch.nn.Module.__init__(layer)
    impl = fi.FlashInferMLASparseImpl.__new__(fi.FlashInferMLASparseImpl)
    impl.dcp_world_size, impl.pcp_world_size, impl.dcp_rank = dcp, 1, 0
    impl.supports_quant_query_input = False
    impl.masked_mha_available = False
    impl.need_to_return_lse_for_decode = True

    def forward_mqa(q, kv_cache, attn_metadata, layer_):  # GPU kernel boundary
        q = torch.cat(q, dim=-1) if isinstance(q, tuple) else q
        assert q.shape[1] == dcp * NUM_HEADS, q.shape
        n = q.shape[0]
        out = torch.randn(n, dcp * NUM_HEADS, LORA, generator=gen)
        lse = torch.randn(n, dcp * NUM_HEADS, generator=gen)
        recorder.peer_outs.clear()
        recorder.peer_lses.clear()
        for _ in range(dcp - 1):  # rank 1, 2, ...: same draw order as rank 1 alone for dcp = 2
            recorder.peer_outs.append(torch.randn(n, dcp * NUM_HEADS, LORA, generator=gen))
            recorder.peer_lses.append(torch.randn(n, dcp * NUM_HEADS, generator=gen))
        return out, lse

    impl.forward_mqa = forward_mqa
    layer.impl = impl
    for name, value in dict(
        num_heads=NUM_HEADS, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, kv_lora_rank=LORA,
        v_head_dim=V, q_pad_num_heads=None, use_pcp=False, kv_cache_dtype="auto",
        prefill_backend=None, is_aiter_triton_fp4_bmm_enabled=False,
        is_aiter_triton_fp8_bmm_enabled=False, is_amx_bmm_enabled=False,  # read from 0.29.0 on
        hisparse_cache=None,  # read from 0.33.0 on
        _vllm_config=vllm_config, layer_name=layer_name,
        # dcp-project-before-merge's state as __init__ leaves it with the switch off (the
        # projected order runs on GLM-5's path in glm5_path.py); unread by a base without it
        dcp_project_before_merge=False, W_UV_dcp=None,
        attn_backend=fi.FlashInferMLASparseTRTLLMBackend, W_UK_T_dcp_qrep=None,
    ).items():
        setattr(layer, name, value)
    layer.W_UK_T = torch.randn(NUM_HEADS, NOPE, LORA, generator=gen)
    layer.W_UV = torch.randn(NUM_HEADS, LORA, V, generator=gen)
    layer._k_scale = torch.ones(())

    def query_gather(q: torch.Tensor) -> torch.Tensor:  # collective boundary (all-gather heads)
        return torch.cat([q] * dcp, dim=1)

    def combine(partial_output, partial_lse, *, seq_lens, query_start_loc):  # collective boundary
        recorder.combine_calls.append(
            {"seq_lens": seq_lens.clone(), "query_start_loc": query_start_loc.clone(),
             "rows": torch.tensor(partial_output.shape[0])})
        lse = partial_lse.clone()
        if transport == "direct":  # the kernel's own checks and its row -> sequence mapping
            _direct_mask(partial_output, lse, seq_lens, query_start_loc, dcp)
        else:
            common.mask_dcp_empty_shards_(lse, seq_lens, query_start_loc)  # what NCCL paths do
        merged = a2a._lse_weighted_combine(
            torch.stack([partial_output, *recorder.peer_outs]).double(),
            torch.stack([lse, *recorder.peer_lses]).double(), is_lse_base_on_e=False)
        return merged[:, :NUM_HEADS].to(partial_output.dtype)  # rank 0's head slice

    manager = dcp_mod.MLADCPManager.__new__(dcp_mod.MLADCPManager)
    manager.query_gather, manager.combine = query_gather, combine
    # what MLADCPManager.__init__ leaves for project_combine (dcp-project-before-merge) over an
    # A2A transport without the fused opt-in; unread by a base without the patch
    manager.fused_project_combine, manager.project_first_min_tokens = None, 0
    manager.v_up_proj_combine = None  # 0.34.0: set only for an NCCL a2a combine it built itself
    layer.dcp_manager = manager
    with set_current_vllm_config(vllm_config):
        vllm_config.compilation_config.static_forward_context[layer_name] = layer
    return layer


def expected_rows(layer, recorder: Recorder, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Every MQA row merged over all ranks (no row masked) and projected by W_UV."""
    a2a = compat.module("dcp_alltoall")
    merged = a2a._lse_weighted_combine(
        torch.stack([out, *recorder.peer_outs]).double(), torch.stack([lse, *recorder.peer_lses]).double(),
        is_lse_base_on_e=False)[:, :NUM_HEADS].float()
    return torch.einsum("bnl,nlv->bnv", merged, layer.W_UV.float()).reshape(out.shape[0], -1)


def run_forward(layer, metadata, num_tokens: int, seed: int = 1):
    """Call the real ``forward_impl``; return (output, the partials the kernel produced)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, NUM_HEADS, NOPE + ROPE, generator=gen)
    kv = torch.randn(num_tokens, LORA, generator=gen)
    pe = torch.randn(num_tokens, ROPE, generator=gen)
    output = torch.zeros(num_tokens, NUM_HEADS * V)
    produced: dict[str, torch.Tensor] = {}
    inner = layer.impl.forward_mqa

    def spy(*args):
        produced["out"], produced["lse"] = inner(*args)
        return produced["out"], produced["lse"]

    layer.impl.forward_mqa = spy
    try:
        with compat.exercising("MLAAttention.forward_impl"):
            layer.forward_impl(q, kv, pe, torch.empty(0), metadata, output=output)
    finally:
        layer.impl.forward_mqa = inner
    return output, produced
