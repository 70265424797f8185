"""GLM-5's own attention under DCP on CPU ranks: what every claim of the series is judged on.

The patch tests before this harness drove the functions our patches change (``MLAAttention.
forward_impl`` on a layer built without ``__init__``); since vLLM 0.29.0 GLM-5 does not run that
function. This harness runs what the release runs for ``GlmMoeDsaForCausalLM``:

- :func:`resolve`: the release's own model registry entry for the architecture, imported as on
  CUDA (the module's platform branch taken with ``current_platform.is_cuda()`` true), and the
  attention class that model's decoder layer builds (the release facts, ``overlay/releases/``: read from
  the tree under test, a model class they do not know refused in one line naming it);
- that class built by its real ``__init__`` on ``world`` ranks over gloo (TP = DCP = ``world``;
  1 is the reference) with the backend Hopper picks for the ``fp8_ds_mla`` cache (FlashMLA-sparse),
  ``kv_b_proj`` loaded through its ``weight_loader`` from one global weight, and vLLM's real
  ``process_weights_after_loading`` (so the manager, its workspace and ``W_UV`` are the release's);
- its DCP section as the model enters it (the facts' entry): 0.28.0's ``deepseek_v2`` wrapper calls
  ``MLAAttention.forward_impl``; 0.29.0+'s ``DeepseekV32Attention`` its own
  ``_sparse_indexer_and_attn`` (indexer, query gather, ``forward_mqa``, combine, ``W_UV``).

Replaced at their call boundary only: FlashMLA's sparse decode and its scheduler metadata, the
index-conversion Triton kernels (``flashmla_standins``), the indexer's logits and local top-k
kernels (each rank scores the positions it owns; the release's own DCP top-k merge then runs, its
pack, exchange and selector kernels from ``dcp_topk_standins``), the direct A2A op (``kernel_contracts``:
the release's own argument checks), the symmetric-memory allocation and direct query gather
(``dcp_direct_harness``), the NCCL a2a pack kernels and the ag_rs correction kernel (torch), and the
dense-MHA prefill's kernels (``glm5_prefill_standins``: FlashAttention by the release's own CPU
prefill backend, or where it has none (0.28.0) by our torch one of FlashAttention's varlen contract, the fp8
context gather with its host checks, the LSE merge op with the CUDA op's contract). Not run: the
projections, norms and RoPE before the attention (0.29.0+: fused Triton kernels), identical at every
DCP size and touched by no patch: the harness hands the section the query and KV they give.

A step (:class:`Case`) is what a server hands the layer: decodes, MTP-5 verification, prefills (the
release's metadata builder routes them, 0.28.0 on: sparse MQA, or dense MHA when the longest prefill is at
most ``index_topk``),
mixed batches, with CUDA-graph padding rows outside or inside the metadata and long-context LSEs.
``CASES`` are the steps the projection patch's tests run (``index_topk`` 128); ``STEPS`` the rest
(``test_glm5_steps.py``; ``index_topk`` 512, so that a prefill past the 256-token decode threshold can
still be dense).

Every rank writes one report (:func:`worker`): per run (transport, projection switch) the combine
calls it saw (which op, the head dim it carried), per case the route the release's metadata builder chose
(``prefill.use_dense_mha``) and the paths it took (dense MHA, sparse MQA, the context KV gather), its seconds
and its output, saved as a tensor, or the error it raised.
``test_dcp_project_before_merge__glm5_path.py`` and ``test_glm5_steps.py`` compare DCP 2 (and 4)
against DCP 1.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ranks import fatal_report, spawn_ranks

ARCH = "GlmMoeDsaForCausalLM"
HEADS = 8  # attention heads of the test model (4 per rank at TP 2)
NOPE, ROPE, LORA, V = 64, 64, 512, 256  # GLM-5's kv_lora_rank, rope and v_head_dim; a small nope
TOPK = 512  # index_topk: the smallest the DCP top-k merge takes (512, 1024, 2048); a multiple of the conversion tile
BLOCK = 64
MTP = 5  # speculative tokens: MTP-5 verification steps are (1 + 5)-token decodes
TRANSPORTS = ("ag_rs", "nccl_a2a", "direct_a2a")


@dataclass(frozen=True)
class Case:
    """One step: per request its query length and its length after the step; ``only`` picks, for
    some rows, the positions their top-k may take (``"even"``/``"odd"``: owned by one rank at DCP 2,
    interleave 1, so the other rank owns none of them).

    ``pad_tokens``: rows past the step's tokens in every tensor the layer is handed, outside the
    metadata (a piecewise CUDA graph's padded batch: ``num_actual_tokens`` counts the real rows).
    ``pad_reqs``: requests of ``1 + MTP`` query rows and no KV appended to the batch, inside the
    metadata (a FULL decode graph's padded uniform batch as Model Runner V2 builds it: their
    ``query_start_loc`` stays at the real token count, ``seq_lens`` 0, ``num_actual_tokens`` counts
    every padded row). ``offset``: every score of the step raised by this much (through one RoPE
    dimension), so LSEs sit where long contexts put them and every merge's overflow guard is used."""

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    only: tuple[str | None, ...] = ()
    pad_tokens: int = 0
    pad_reqs: int = 0
    offset: bool = False

    @property
    def prefill_max_seq_len(self) -> int:
        """The longest sequence of the prefills (query longer than the decode threshold); 0 if none."""
        return max((s for q, s in zip(self.query_lens, self.seq_lens, strict=True) if q > DECODE_THRESHOLD),
                   default=0)

    @property
    def dense(self) -> bool:
        """The release routes the step's prefills to dense MHA (0.28.0 on: the metadata builder's
        ``use_dense_mha``, 0.34.0 through ``_use_dense_mha_prefill``: the longest prefill sequence at most
        ``index_topk``)."""
        return 0 < self.prefill_max_seq_len <= TOPK

    @property
    def merges(self) -> bool:
        """A DCP merge runs: some rows attend through the sparse MQA path (decodes always; prefills
        unless dense)."""
        return any(q <= DECODE_THRESHOLD for q in self.query_lens) or not self.dense


# FlashMLA-sparse's batch split on Hopper (``FlashMLASparseMetadataBuilder``: 256 query tokens below 16
# heads per rank, GLM-5's 8 at TP 8 included): a longer query is a prefill, a shorter one a (varlen) decode.
DECODE_THRESHOLD = 256

# A common score offset of OFFSET_Q * OFFSET_K * scale (about 543): exp() of such an LSE overflows
# float32, as a merge that forgets to subtract the max would.
OFFSET_Q, OFFSET_K = 64.0, 96.0

CASES: dict[str, Case] = {
    # a request past 2 * TOPK in each: at DCP 2 a rank's local top-k then leaves out positions it owns
    "decode": Case((1, 1, 1), (1300, 170, 37)),
    "mtp5": Case((1 + MTP, 1 + MTP), (260, 1400)),
    "mixed": Case((1, 1 + MTP, 40), (300, 1250, 240)),
    "forced_mqa_prefill": Case((48,), (1200,)),
    "empty_rows": Case((1, 1, 1, 1), (1100, 1100, 1200, 90), ("even", "odd", "even", None)),
}

# Every other step GLM-5 takes under DCP (``test_glm5_steps.py``): the smallest decode, requests
# shorter than the DCP group, CUDA-graph padding both ways, long-context LSEs, the dense-MHA prefill of
# short prompts (with and without cached context, at and past its routing threshold) and mixed with
# decodes.
STEPS: dict[str, Case] = {
    "one_token": Case((1,), (900,)),
    "short_requests": Case((1, 1, 1), (1, 2, 3)),
    "padded_rows": Case((1, 1, 1), (900, 600, 37), pad_tokens=5),
    "padded_mtp5_graph": Case((1 + MTP, 1 + MTP), (700, 800), pad_reqs=2),
    "large_lse_mtp5": Case((1, 1 + MTP), (900, 650), offset=True),
    "dense_prefill": Case((300,), (300,)),
    "dense_prefill_context": Case((280,), (480,)),
    "dense_at_topk": Case((300,), (TOPK,)),
    "mqa_past_topk": Case((300,), (TOPK + 1,)),
    "dense_mixed": Case((1 + MTP, 1 + MTP, 280), (900, 700, 450)),
    "large_lse_dense_context": Case((280,), (480,), offset=True),
}


def case_of(name: str) -> Case:
    return CASES[name] if name in CASES else STEPS[name]


GLM5_CONFIG: dict[str, Any] = {
    "architectures": [ARCH], "model_type": "glm_moe_dsa", "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "q_lora_rank": 64, "kv_lora_rank": LORA,
    "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V, "index_topk": TOPK,
    "index_head_dim": 128, "index_n_heads": 4, "intermediate_size": 512, "moe_intermediate_size": 128,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "vocab_size": 1024, "max_position_embeddings": 8192, "rope_theta": 10000, "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 1,
}


# --------------------------------------------------------------------------------------------
# the model's path, from the release's registry
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelPath:
    model_class: str  # module.qualname of what the registry resolves on CUDA
    attention: type
    entry: str  # "forward_impl" | "sparse_indexer_and_attn"

    def describe(self) -> dict[str, str]:
        return {"model_class": self.model_class,
                "attention_class": f"{self.attention.__module__}.{self.attention.__qualname__}",
                "entry": self.entry}


def import_as_on_cuda(name: str):
    """Import module ``name`` (fresh) with ``current_platform.is_cuda()`` true where that module's own
    code asks, so its platform branch resolves as on a CUDA machine (what it imports asks the real
    platform: their import-time capability probes need a GPU)."""
    from vllm.platforms import current_platform

    saved = current_platform.is_cuda
    sys.modules.pop(name, None)
    try:
        current_platform.is_cuda = lambda: sys._getframe(1).f_globals.get("__name__") == name or saved()
        return importlib.import_module(name)
    finally:
        current_platform.is_cuda = saved


def release_path():
    """GLM-5's path as the release facts read it in the tree of the vLLM under test (``overlay.releases``)."""
    import compat
    import vllm

    from overlay.releases.facts import ReleaseFactsError, glm5_path

    try:
        return glm5_path(Path(vllm.__file__).parent.parent)
    except ReleaseFactsError as exc:
        raise compat.HarnessError(str(exc)) from None


def resolve() -> ModelPath:
    """The attention class GLM-5 runs on CUDA in the vLLM under test, from its own registry and the release
    facts (which must read the same model class in its tree)."""
    import compat
    from vllm.model_executor.models import registry

    with compat.setup(f"the registry entry of {ARCH}"):
        rel, cls_name = registry._VLLM_MODELS[ARCH]
        module = import_as_on_cuda(registry._resolve_module_name(rel))
        model = getattr(module, cls_name)
    key = f"{model.__module__}.{model.__qualname__}"
    path = release_path()
    if path.model_class != key:
        raise compat.HarnessError(f"{ARCH} resolves to {key} in this release; its release facts read "
                                  f"{path.model_class}")
    return ModelPath(key, getattr(importlib.import_module(path.attention_module), path.attention_class), path.entry)


# --------------------------------------------------------------------------------------------
# the config, the CPU environment, the module
# --------------------------------------------------------------------------------------------
def write_model_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"config.json.{os.getpid()}"
    tmp.write_text(json.dumps(GLM5_CONFIG))
    os.replace(tmp, root / "config.json")
    return root


def make_vllm_config(model_dir: Path, world: int, max_tokens: int = 256):
    """TP = DCP = ``world`` serving the test model with the fp8_ds_mla cache and MTP-5, at most
    ``max_tokens`` tokens a step."""
    import compat
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    with compat.setup("the VllmConfig of the GLM-5 test model"):
        model = ModelConfig(model=str(model_dir), tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16",
                            max_model_len=8192)
        parallel = ParallelConfig(tensor_parallel_size=world, decode_context_parallel_size=world,
                                  **({"dcp_comm_backend": "a2a"} if world > 1 else {}))
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=MTP, target_model_config=model,
                                 target_parallel_config=parallel)
        return VllmConfig(model_config=model, parallel_config=parallel,
                          cache_config=CacheConfig(cache_dtype="fp8_ds_mla", block_size=BLOCK),
                          scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_tokens,
                                                           max_model_len=8192, is_encoder_decoder=False),
                          device_config=DeviceConfig(device="cpu"), speculative_config=spec)


def install_cpu_env() -> None:
    """What a CUDA machine gives vLLM's constructors, on CPU (kernels at their boundary, see the
    module docstring); FlashMLA-sparse as the attention backend, as Hopper selects for fp8_ds_mla, and
    FlashAttention as the dense-MHA prefill backend (``glm5_prefill_standins``)."""
    import compat
    import flashmla_standins as fk
    import sparse_dcp_harness as h
    import torch
    from vllm.v1.worker import workspace

    fs = compat.module("flashmla_sparse")
    mla = compat.module("mla_attention")
    torch.accelerator.empty_cache = lambda: None
    torch.accelerator.synchronize = lambda *a, **k: None
    torch.cuda.is_current_stream_capturing = lambda: False  # eager steps: nothing is captured on CPU
    h.no_pinned_memory(setattr)
    fs.num_compute_units = lambda index=None: 132
    fs.torch = h.UnpinnedTorch()
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device("cpu"))
    fk.cpu_kernels()
    from vllm import _custom_ops as ops

    def concat_mla_q(ql_nope, q_pe, out):  # the CUDA copy kernel: out = [ql_nope | q_pe]
        out.copy_(torch.cat([ql_nope, q_pe], dim=-1))

    ops.concat_mla_q = concat_mla_q
    install_cpu_streams()
    assert "fp8_ds_mla" in fs.FlashMLASparseBackend.supported_kv_cache_dtypes
    mla.get_attn_backend = lambda *a, **k: fs.FlashMLASparseBackend
    prefill = importlib.import_module("glm5_prefill_standins")
    standin = prefill.flash_attn_prefill_standin()
    mla.get_mla_prefill_backend = lambda vllm_config: standin


class CpuStream:
    """A CUDA stream on a machine with one stream of work: waits are already satisfied."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def __enter__(self) -> CpuStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class CpuEvent:
    """A CUDA event on one stream: recording orders nothing that is not ordered already."""

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


class CpuStreamsTorch:
    """``torch`` for the index-group module, whose builder makes its side stream and events with
    ``torch.Stream`` / ``torch.Event`` itself (0.34.0): those are :class:`CpuStream` and
    :class:`CpuEvent`, everything else is torch's own."""

    Event = CpuEvent

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> CpuStream:  # torch's name
        return CpuStream()

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)


def install_cpu_streams() -> None:
    """0.31.0+: the sparse index group converts top-k on a side stream with events; on CPU that is
    the one stream (its Triton conversion is ``flashmla_standins``'s). 0.31.0-0.33.0 make them
    through module functions, 0.34.0 with ``torch.Stream`` / ``torch.Event`` in its builder."""
    try:
        ig = importlib.import_module("vllm.v1.attention.backends.mla.index_group")
    except ImportError:
        return
    ig._create_side_stream = lambda device: CpuStream()
    ig._create_event = CpuEvent
    ig.current_stream = CpuStream
    ig.torch = CpuStreamsTorch()


def install_transports(rank_group: Any, calls: dict[str, int]) -> None:
    """The DCP group's GPU-only exchanges over gloo: ``dcp_direct_harness``'s symmetric memory,
    direct query gather and NCCL a2a pack kernels, the ag_rs correction kernel, and the direct A2A
    op with the release's own argument checks (``kernel_contracts``)."""
    import compat
    import dcp_direct_harness as dh
    import dcp_project_merge_harness as pm
    import kernel_contracts as kc
    import torch

    dh._GROUP["dcp"] = rank_group
    counts = dict.fromkeys(["direct_q_gather", "direct_a2a", "nccl_a2a", "nccl_all_gather"], 0)
    dh._install_standins(counts)
    pm._install_ag_rs_standin()
    torch.ops._C.direct_dcp_a2a_lse_reduce = kc.direct_a2a_lse_reduce(
        compat.vllm_version(), lambda: rank_group.device_group, calls)


def set_transport(vllm_config: Any, transport: str) -> None:
    """Pick the combine the manager built next uses: ag_rs, NCCL a2a, or the direct A2A."""
    import compat

    vllm_config.parallel_config.dcp_comm_backend = "ag_rs" if transport == "ag_rs" else "a2a"
    os.environ["VLLM_USE_DIRECT_DCP_A2A"] = "1" if transport == "direct_a2a" else "0"
    dcp = compat.module("dcp")
    if hasattr(dcp, "get_direct_dcp_a2a_workspace"):
        dcp.get_direct_dcp_a2a_workspace.cache_clear()


def build_attention(path: ModelPath, vllm_config: Any, prefix: str, topk_buffer: Any) -> Any:
    """``path.attention`` built the way the release's decoder layer builds it (under the model's dtype,
    as vLLM's model loader builds the model)."""
    import compat
    from vllm.utils.torch_utils import set_default_torch_dtype

    cfg = vllm_config.model_config.hf_config
    # the code under test: the patches' __init__ hunks (DCP support, the manager's sizing) act here
    with (compat.exercising(f"{path.attention.__name__}.__init__ as the decoder layer calls it"),
          set_default_torch_dtype(vllm_config.model_config.dtype)):
        if path.entry == "forward_impl":  # 0.28.0: DeepseekV2DecoderLayer
            return path.attention(
                vllm_config=vllm_config, config=cfg, hidden_size=cfg.hidden_size,
                num_heads=cfg.num_attention_heads, qk_nope_head_dim=cfg.qk_nope_head_dim,
                qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank,
                kv_lora_rank=cfg.kv_lora_rank, max_position_embeddings=cfg.max_position_embeddings,
                cache_config=vllm_config.cache_config, quant_config=None, prefix=prefix,
                topk_indices_buffer=topk_buffer, reduce_results=True)
        return path.attention(vllm_config=vllm_config, config=cfg, prefix=prefix,  # DeepseekV32DecoderLayer
                              topk_indices_buffer=topk_buffer, index_group_builder=None)


def mla_layer(path: ModelPath, module: Any) -> Any:
    """The ``MLAAttention`` inside the module (0.28.0: the wrapper's; 0.29.0+: the module itself)."""
    return module.mla_attn.mla_attn if path.entry == "forward_impl" else module


def global_kv_b_proj():
    """The model's ``kv_b_proj`` weight, all heads ``[HEADS * (NOPE + V), LORA]`` (bf16)."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    return (torch.randn(HEADS * (NOPE + V), LORA, generator=gen) / math.sqrt(LORA)).to(torch.bfloat16)


def load_weights(layer: Any) -> None:
    """``kv_b_proj`` through its own ``weight_loader`` (this TP rank's rows), then vLLM's real
    ``process_weights_after_loading``."""
    import compat
    import torch

    with compat.setup("kv_b_proj's weight_loader"):
        param = layer.kv_b_proj.weight
        param.weight_loader(param, global_kv_b_proj())
    # 0.34.0 takes no dtype (the layer's own act_dtype, set in __init__ under the model dtype)
    takes_dtype = len(inspect.signature(layer.process_weights_after_loading).parameters) > 0
    with compat.exercising(f"{type(layer).__name__}.process_weights_after_loading"):
        layer.process_weights_after_loading(*((torch.bfloat16,) if takes_dtype else ()))


# --------------------------------------------------------------------------------------------
# one step's data, the same for every DCP size
# --------------------------------------------------------------------------------------------
@dataclass
class Step:
    q: Any  # [T, HEADS, NOPE + ROPE] bf16, after RoPE
    kv: list[Any]  # per request [S, LORA + ROPE] float (the values the cache rows hold)
    raw: list[Any]  # per request [S, 656] uint8 fp8_ds_mla rows
    topk: Any  # [T, TOPK] int32 global positions within the request, -1 padded
    req_ids: list[int]
    positions: list[int]


def make_step(name: str) -> Step:
    import flashmla_standins as fk
    import torch

    case = case_of(name)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    rng = random.Random(name)
    kv = [torch.randn(s, LORA + ROPE, generator=gen) * 0.5 for s in case.seq_lens]
    if case.offset:  # one RoPE dimension of every key (bf16 in the cache: exact)
        for x in kv:
            x[:, LORA] = OFFSET_K
    raw = [fk.quantize_fp8_ds_mla(x) for x in kv]
    kv = [fk.dequantize_fp8_ds_mla(r) for r in raw]
    rows, req_ids, positions = [], [], []
    only = case.only or (None,) * len(case.seq_lens)
    for r, (qlen, slen) in enumerate(zip(case.query_lens, case.seq_lens, strict=True)):
        for pos in range(slen - qlen, slen):
            cand = [t for t in range(pos + 1) if only[r] is None or t % 2 == (only[r] == "odd")]
            picked = rng.sample(cand, min(TOPK, len(cand)))
            row = picked + [-1] * (TOPK - len(picked))
            rng.shuffle(row)
            rows.append(row)
            req_ids.append(r)
            positions.append(pos)
    q = (torch.randn(len(rows), HEADS, NOPE + ROPE, generator=gen) * 0.5).to(torch.bfloat16)
    if case.offset:
        q[:, :, NOPE] = OFFSET_Q
    return Step(q, kv, raw, torch.tensor(rows, dtype=torch.int32), req_ids, positions)


def reference(name: str):
    """What attention computes for the step, in float64 from the same data (the check of the check):
    the query absorbed through each head's ``W_UK``, softmax over the row's top-k, projected by
    ``W_UV``: ``[T, HEADS * V]``."""
    import torch

    step = make_step(name)
    w = global_kv_b_proj().double().view(HEADS, NOPE + V, LORA)
    w_uk, w_uv = w[:, :NOPE], w[:, NOPE:]
    q = step.q.double()
    q_abs = torch.cat([torch.einsum("thp,hpl->thl", q[..., :NOPE], w_uk), q[..., NOPE:]], dim=-1)
    out = torch.zeros(q.shape[0], HEADS, V, dtype=torch.float64)
    for t, (req, row) in enumerate(zip(step.req_ids, step.topk.tolist(), strict=True)):
        keys = step.kv[req][[i for i in row if i >= 0]].double()
        probs = torch.softmax(q_abs[t] @ keys.T * (NOPE + ROPE) ** -0.5, dim=-1)
        out[t] = torch.einsum("hl,hvl->hv", probs @ keys[:, :LORA], w_uv)
    return out.reshape(q.shape[0], HEADS * V)


def rank_cache(step: Step, rank: int, world: int):
    """This rank's fp8_ds_mla cache ``[blocks, BLOCK, 656]`` (the tokens it owns at interleave 1, at
    their local positions) and its block table (one row per request)."""
    import torch

    blocks = max(math.ceil(math.ceil(len(r) / world) / BLOCK) for r in step.raw)
    table = (torch.arange(len(step.raw) * blocks, dtype=torch.int32).view(len(step.raw), blocks) + 1)
    cache = torch.zeros(len(step.raw) * blocks + 2, BLOCK, 656, dtype=torch.uint8)
    for req, raw in enumerate(step.raw):
        for t in range(rank, raw.shape[0], world):
            local = t // world
            cache[table[req, local // BLOCK], local % BLOCK] = raw[t]
    return cache, table


def build_metadata(vllm_config: Any, layer_name: str, name: str, table: Any):
    """The release's own ``FlashMLASparseMetadataBuilder`` for the step (global ``seq_lens``, this
    rank's block table)."""
    import compat
    import sparse_dcp_harness as h
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    case = case_of(name)
    with compat.setup("FlashMLASparseMetadataBuilder.build"):
        spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LORA + ROPE, dtype=torch.uint8,
                                cache_dtype_str="fp8_ds_mla")
        builder = compat.symbol("flashmla_sparse", "FlashMLASparseMetadataBuilder")(
            spec, [layer_name], vllm_config, torch.device("cpu"))
        num_real = sum(case.query_lens)
        # a FULL graph's padded requests: query_start_loc held at the real token count, no KV
        qsl = torch.tensor([0, *torch.tensor(case.query_lens).cumsum(0).tolist()] + [num_real] * case.pad_reqs,
                           dtype=torch.int32)
        seq_lens = torch.tensor(case.seq_lens + (0,) * case.pad_reqs, dtype=torch.int32)
        num_actual = num_real + case.pad_reqs * (1 + MTP)
        if case.pad_reqs:
            table = torch.cat([table, torch.zeros(case.pad_reqs, table.shape[1], dtype=table.dtype)])
        common = h.common_attention_metadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens,
            num_reqs=len(seq_lens), num_actual_tokens=num_actual, max_query_len=max(case.query_lens),
            max_seq_len=max(case.seq_lens), block_table_tensor=table,
            slot_mapping=torch.full((num_actual,), -1, dtype=torch.int64),
            seq_lens_cpu_upper_bound=seq_lens.clone(), _seq_lens_cpu=seq_lens.clone())
        return builder.build(0, common)


def run_step(path: ModelPath, module: Any, layer: Any, vllm_config: Any, name: str, rank: int, world: int):
    """One step through the model's DCP section; this rank's output ``[T, heads_per_rank * V]``."""
    import compat
    import torch
    from vllm.forward_context import set_forward_context

    step = make_step(name)
    case = case_of(name)
    heads = HEADS // world
    q = step.q[:, rank * heads:(rank + 1) * heads]
    num_tokens = q.shape[0]
    # CUDA-graph padding: rows past the step's tokens, garbage in every input, NaN in the output
    rows = num_tokens + case.pad_tokens + case.pad_reqs * (1 + MTP)
    gen = torch.Generator().manual_seed(7 + rank)
    q = torch.cat([q, torch.randn(rows - num_tokens, heads, NOPE + ROPE, generator=gen).to(q.dtype)]).contiguous()
    cache, table = rank_cache(step, rank, world)
    layer.kv_cache = cache
    metadata = build_metadata(vllm_config, layer.layer_name, name, table)
    prefill = getattr(metadata, "prefill", None)
    _ROUTE["dense"] = None if prefill is None else getattr(prefill, "use_dense_mha", None)
    # 0.29.0+: forward's fused_norm_rope clears the buffer and the indexer (install_indexer) fills it; 0.28.0's
    # section (forward_impl) starts after the indexer: the buffer holds the step's global top-k
    layer.impl.topk_indices_buffer[:num_tokens] = -1 if path.entry == "sparse_indexer_and_attn" else step.topk
    _STEP["now"] = (name, step)
    layer.impl.topk_indices_buffer[num_tokens:rows] = -1
    new_kv = torch.stack([step.kv[r][p] for r, p in zip(step.req_ids, step.positions, strict=True)])
    new_kv = torch.cat([new_kv, torch.randn(rows - num_tokens, LORA + ROPE, generator=gen)])
    kv_c, k_pe = new_kv[:, :LORA].to(torch.bfloat16), new_kv[:, LORA:].to(torch.bfloat16)
    output = torch.full((rows, heads * V), float("nan"), dtype=torch.bfloat16)
    slots = {layer.layer_name: torch.full((rows,), -1, dtype=torch.int64)}
    with set_forward_context({layer.layer_name: metadata}, vllm_config, slot_mapping=slots):
        if path.entry == "forward_impl":
            with compat.exercising("MLAAttention.forward_impl (deepseek_v2's GLM-5 attention)"):
                layer.forward_impl(q, kv_c, k_pe.unsqueeze(1), cache, metadata, output=output)
            return output[:num_tokens]
        q_nope, q_pe = q.split([NOPE, ROPE], dim=-1)
        # forward's own lines: a dense-MHA step (outside a FULL graph) skips the absorption
        absorb = getattr(module, "_should_prepare_mqa_query", None)
        eager = importlib.import_module("vllm.config").CUDAGraphMode.NONE
        ql_nope = (torch.bmm(q_nope.transpose(0, 1), module.W_UK_T).transpose(0, 1)
                   if absorb is None or absorb(metadata, eager) else q_nope)
        positions = torch.tensor(step.positions + [0] * (rows - num_tokens), dtype=torch.int64)
        dummy = torch.zeros(rows, 1)
        with compat.exercising("DeepseekV32Attention._sparse_indexer_and_attn (GLM-5's attention)"):
            module._sparse_indexer_and_attn(positions, torch.zeros(rows, 64, dtype=torch.bfloat16), q_nope,
                                            q_pe, dummy, None, dummy, kv_c, k_pe, ql_nope, q_pe, output)
    return output[:num_tokens]


def install_indexer(path: ModelPath, steps: dict[str, Any]) -> None:
    """0.29.0+: the indexer op ``_sparse_indexer_and_attn`` calls, as it runs under DCP: each rank scores
    the positions it owns (:func:`indexer_scores`: the same scores at every DCP size, no ties) and takes
    its local top-k over them, as the logits and top-k kernels do; then the release's own
    ``_merge_dcp_topk_global`` merges the ranks' top-k into the step's global top-k in
    ``topk_indices_buffer``, with the arguments the release's op passes it (``dcp_topk_standins``: only
    its compiled kernels stood in). Decode rows merge in one call, a prefill's rows in another, as the
    op's decode and prefill branches do. The report's ``indexer`` records each call (DCP rank and size)
    and each merge (rows, which exchange ran)."""
    if path.entry != "sparse_indexer_and_attn":
        return
    import compat
    import dcp_topk_standins as ts
    from vllm.distributed.parallel_state import get_dcp_group

    module = sys.modules[path.attention.__module__]
    kernels: dict[str, int] = {}
    if not ts.install(compat.vllm_version(), lambda: get_dcp_group().device_group, kernels):
        raise compat.HarnessError(f"{ts.INDEXER} has no _merge_dcp_topk_global for the indexer stand-in to call")
    indexer = importlib.import_module(ts.INDEXER)
    signature = inspect.signature(indexer.sparse_attn_indexer)
    merge = indexer._merge_dcp_topk_global
    merge_takes = set(inspect.signature(merge).parameters)

    def sparse_attn_indexer(*args: Any, **kwargs: Any) -> Any:
        import torch

        a = signature.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        steps["indexer_calls"] = steps.get("indexer_calls", 0) + 1
        steps["indexer_dcp"] = [a["dcp_rank"], a["dcp_world_size"]]
        name, step = _STEP["now"]
        rank, world, interleave = a["dcp_rank"], a["dcp_world_size"], a["cp_kv_cache_interleave_size"]
        topk, buffer = a["topk_tokens"], a["topk_indices_buffer"]
        logits_dtype = a.get("logits_dtype", torch.float32)
        for rows in indexer_row_groups(step):
            logits, local = local_topk(step, rows, rank, world, interleave, topk, logits_dtype)
            out = buffer[rows, :topk]
            out.copy_(local)
            before = dict(kernels)
            extra = {"logits_dtype": logits_dtype, "num_positions": a["max_model_len"],
                     "direct_max_rows": a.get("dcp_direct_topk_max_rows", 0)}
            with compat.exercising("sparse_attn_indexer._merge_dcp_topk_global (the indexer's DCP top-k merge)"):
                merge(logits, out, topk, rank, world, interleave,
                      **{k: v for k, v in extra.items() if k in merge_takes})
            ran = {k: kernels.get(k, 0) - before.get(k, 0) for k in kernels}
            steps.setdefault("merges", []).append({
                "case": name, "rows": rows.stop - rows.start, "world": world,
                "direct_max_rows": extra["direct_max_rows"],
                "exchange": ("direct" if ran.get("topk_push") else "all_gather" if ran.get("topk_select_gathered")
                             else "none"),
                "kernels": {k: v for k, v in ran.items() if v}})
        return buffer

    module.sparse_attn_indexer = sparse_attn_indexer


_STEP: dict[str, tuple[str, Step]] = {}  # the step run_step is running, for the indexer stand-in
_ROUTE: dict[str, bool | None] = {}  # "dense": the release's route of the step's prefills (None: no prefill)


def indexer_row_groups(step: Step) -> list[slice]:
    """The rows each merge of the indexer op takes: the decode rows (the leading requests of at most
    ``1 + MTP`` tokens, the indexer's decode threshold; the batch is ordered decodes first) in one, the
    prefill rows (one chunk: the cases fit one) in another."""
    sizes = [step.req_ids.count(r) for r in sorted(set(step.req_ids))]
    decodes = 0
    for size in sizes:
        if size > 1 + MTP:
            break
        decodes += size
    return [rows for rows in (slice(0, decodes), slice(decodes, len(step.req_ids))) if rows.start < rows.stop]


def indexer_scores(step: Step, row: int, dtype: Any) -> Any:
    """Row ``row``'s indexer scores over positions ``0..pos`` (float32 holding ``dtype`` values): the
    positions of the row's top-k (``step.topk``) above every other, all distinct (so the global top-k of
    every DCP size is ``step.topk``'s, ties out of the selection), from the row alone."""
    import torch

    pos = step.positions[row]
    picked = [t for t in step.topk[row].tolist() if t >= 0]
    others = sorted(set(range(pos + 1)) - set(picked))
    gen = torch.Generator().manual_seed(7919 * row + pos)
    order = [others[i] for i in torch.randperm(len(others), generator=gen).tolist()]
    order += [picked[i] for i in torch.randperm(len(picked), generator=gen).tolist()]
    scores = torch.empty(pos + 1, dtype=torch.float64)
    scores[torch.tensor(order, dtype=torch.long)] = torch.arange(pos + 1, dtype=torch.float64)
    # 2^(k/64): one step apart is a ratio of 1.011, wider than bf16's rounding, so no two round equal
    return torch.exp2(scores / 64).to(dtype).float()


def local_topk(step: Step, rows: slice, rank: int, world: int, interleave: int, topk: int, dtype: Any):
    """The logits and top-k kernels' output on this rank for ``rows``: ``[R, L]`` float32 logits over its
    local positions (``-inf`` past each row's own), and each row's top-k local positions (best first,
    ``-1`` padded)."""
    import compat
    import torch

    owned, scores = [], []
    for row in range(rows.start, rows.stop):
        s = indexer_scores(step, row, dtype)
        t = torch.arange(s.numel())
        mine = t[(t // interleave) % world == rank]
        if torch.unique(s).numel() != s.numel():
            raise compat.HarnessError(f"indexer scores of row {row} tie: the merge's order would decide")
        owned.append(mine)
        scores.append(s[mine])
    width = max(1, max(m.numel() for m in owned))
    logits = torch.full((len(owned), width), float("-inf"), dtype=torch.float32)
    local = torch.full((len(owned), topk), -1, dtype=torch.int32)
    for i, s in enumerate(scores):
        logits[i, : s.numel()] = s  # local position l holds the l-th owned position's score
        best = torch.argsort(s, descending=True)[:topk]
        local[i, : best.numel()] = best.to(torch.int32)
    return logits, local


# --------------------------------------------------------------------------------------------
# ranks
# --------------------------------------------------------------------------------------------
PROJECTION = ("off", "auto", "on")
"""The values of the W_UV projection before the DCP merge a run builds with (:func:`set_projection`)."""
PROJECTION_FIELD = "dcp_v_up_proj_before_merge"
"""``ParallelConfig``'s field for it (0.34.0's series); 0.28.0's series reads ``VLLM_DCP_PROJECT_BEFORE_MERGE``."""


def runs_for(world: int) -> list[tuple[str, str]]:
    """(transport, projection value) of each build: at DCP 1 one build (neither matters)."""
    if world == 1:
        return [("none", "off")]
    return [(t, p) for t in TRANSPORTS for p in PROJECTION]


def has_projection_switch() -> bool:
    """The tree under test has a switch for the projection (the config field or 0.28.0's env var)."""
    import compat
    from vllm.config import ParallelConfig

    return PROJECTION_FIELD in ParallelConfig.__dataclass_fields__ or hasattr(
        compat.module("mla_attention").MLAAttention, "use_dcp_project_before_merge")


def set_projection(vllm_config: Any, value: str) -> None:
    """The W_UV projection before the DCP merge of the layers built next: ``value`` (off / auto / on) in
    ``ParallelConfig.dcp_v_up_proj_before_merge`` where the release has the field, else in 0.28.0's
    ``VLLM_DCP_PROJECT_BEFORE_MERGE`` (off 0, on 1, auto unset: the release's default)."""
    if value not in PROJECTION:
        raise ValueError(f"projection value {value!r}: expected one of {', '.join(PROJECTION)}")
    parallel = vllm_config.parallel_config
    if PROJECTION_FIELD in type(parallel).__dataclass_fields__:
        setattr(parallel, PROJECTION_FIELD, value)
    os.environ.pop("VLLM_DCP_PROJECT_BEFORE_MERGE", None)
    if value != "auto":
        os.environ["VLLM_DCP_PROJECT_BEFORE_MERGE"] = "1" if value == "on" else "0"


def output_file(out_dir: Path | str, world: int, transport: str, project: str, case: str, rank: int) -> Path:
    return Path(out_dir, f"dcp{world}-{transport}-{project}-{case}-rank{rank}.pt")


def worker(rank: int, world: int, port: int, model_dir: str, out_dir: str, sys_path: list[str],
           cases: list[str], runs: list[tuple[str, str]] | None = None) -> None:
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    report: dict[str, Any] = {"rank": rank, "world": world, "runs": []}
    try:
        import compat
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import (
            get_dcp_group,
            init_distributed_environment,
            initialize_model_parallel,
        )

        rows = max(sum(case_of(n).query_lens) + case_of(n).pad_tokens + case_of(n).pad_reqs * (1 + MTP)
                   for n in cases)
        vc = make_vllm_config(write_model_dir(Path(model_dir)), world, max(256, 1 << (rows - 1).bit_length()))
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(tensor_model_parallel_size=world, decode_context_model_parallel_size=world)
            install_cpu_env()
            path = resolve()
            report["path"] = path.describe()
            report["release"] = str(compat.vllm_version())
            # the projection patch is in the tree (its switch exists), whether or not this path takes it
            report["has_projection"] = has_projection_switch()
            calls: dict[str, int] = {}
            if world > 1:
                install_transports(get_dcp_group(), calls)
            importlib.import_module("glm5_prefill_standins").install(get_dcp_group() if world > 1 else None)
            seen: dict[str, Any] = {}
            install_indexer(path, seen)
            for i, (transport, project) in enumerate(runs or runs_for(world)):
                run: dict[str, Any] = {"transport": transport, "project": project, "cases": {}}
                report["runs"].append(run)
                if world > 1:
                    set_transport(vc, transport)
                set_projection(vc, project)
                topk_buffer = torch.full((vc.scheduler_config.max_num_batched_tokens, TOPK), -1, dtype=torch.int32)
                module = build_attention(path, vc, f"model.layers.{i}.self_attn", topk_buffer)
                layer = mla_layer(path, module)
                load_weights(layer)
                dims = spy_combines(layer)
                steps = spy_steps(layer)
                run["manager_output_head_dim"] = getattr(layer.dcp_manager, "output_head_dim", None)
                run["project_flag"] = bool(getattr(layer, "dcp_project_before_merge", False))
                w_uv_dcp = getattr(layer, "W_UV_dcp", None)
                run["W_UV_dcp"] = None if w_uv_dcp is None else list(w_uv_dcp.shape)
                for name in cases:
                    dims.clear()
                    steps.clear()
                    before = dict(calls)
                    _ROUTE.clear()
                    started = time.perf_counter()
                    try:
                        out = run_step(path, module, layer, vc, name, rank, world)
                        torch.save(out, output_file(out_dir, world, transport, project, name, rank))
                        result: dict[str, Any] = {"ok": True}
                    except Exception as exc:
                        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                  "error_kind": getattr(type(exc), "overlay_failure", "behaviour")}
                        cause = exc.__cause__ or exc.__context__
                        if cause is not None:
                            result["cause"] = f"{type(cause).__name__}: {cause}"
                        result["where"] = traceback.format_exception(exc)[-12:]
                    result["seconds"] = round(time.perf_counter() - started, 3)
                    result["combines"] = list(dims)
                    result["steps"] = dict(steps)
                    result["dense_route"] = _ROUTE.get("dense")
                    result["direct_a2a_calls"] = calls.get("direct_a2a", 0) - before.get("direct_a2a", 0)
                    run["cases"][name] = result
                    if world > 1:
                        get_dcp_group().barrier()
            report["indexer"] = seen
    except Exception as exc:
        report.update(fatal_report(exc))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))


def spy_combines(layer: Any) -> list[dict[str, Any]]:
    """Record each call of the layer's DCP combines: which one and the head dim its partials carry."""
    seen: list[dict[str, Any]] = []
    manager = layer.dcp_manager
    if manager is None:
        return seen
    for name in ("combine", "project_combine", "v_up_proj_combine"):
        inner = getattr(manager, name, None)
        if inner is None:
            continue

        def spy(partial, *args: Any, _inner=inner, _name=name, **kwargs: Any):
            seen.append({"op": _name, "head_dim": int(partial.shape[-1]),
                         "bounds": kwargs.get("seq_lens") is not None})
            return _inner(partial, *args, **kwargs)

        setattr(manager, name, spy)
    helper = getattr(layer, "_dcp_combine_v_up_proj", None)  # the layer's merge-and-project, where it has one
    if helper is not None:
        def helper_spy(partial, *args: Any, **kwargs: Any):
            seen.append({"op": "layer._dcp_combine_v_up_proj", "head_dim": int(partial.shape[-1]),
                         "bounds": kwargs.get("seq_lens") is not None})
            return helper(partial, *args, **kwargs)

        layer._dcp_combine_v_up_proj = helper_spy
    return seen


def spy_steps(layer: Any) -> dict[str, int]:
    """Count what a step ran besides the merges: the dense-MHA prefill (``impl.forward_mha``), the sparse
    MQA attention (``impl.forward_mqa``) and, under DCP, the context KV gather (``kv_gather``)."""
    seen: dict[str, int] = {}

    def counted(owner: Any, name: str, key: str) -> None:
        inner = getattr(owner, name, None)
        if inner is None:
            return

        def spy(*args: Any, **kwargs: Any):
            seen[key] = seen.get(key, 0) + 1
            return inner(*args, **kwargs)

        setattr(owner, name, spy)

    counted(layer.impl, "forward_mha", "dense_mha")
    counted(layer.impl, "forward_mqa", "mqa")
    if layer.dcp_manager is not None:
        counted(layer.dcp_manager, "kv_gather", "kv_gather")
    return seen


def run_ranks(tmp: Path, world: int, cases: list[str] | None = None, timeout: float = 600,
              runs: list[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """:func:`worker` on ``world`` gloo ranks; each rank's report (outputs under ``tmp``)."""
    names = list(cases or CASES)
    return spawn_ranks(worker, lambda r, port: (r, world, port, str(tmp / "model"), str(tmp), list(sys.path), names,
                                                runs), tmp, world=world, timeout=timeout)


# --------------------------------------------------------------------------------------------
# reading the reports (the tests' side)
# --------------------------------------------------------------------------------------------
def case_results(reports: list[dict[str, Any]], transport: str, project: str, case: str) -> list[dict[str, Any]]:
    """Each rank's result of ``case`` in the run of (``transport``, ``project``)."""
    out = []
    for rep in reports:
        (run,) = [r for r in rep["runs"] if r["transport"] == transport and r["project"] == project]
        out.append(run["cases"][case])
    return out


def raise_for(result: dict[str, Any], rank: int) -> None:
    """A failed case's error again, as the failure it was (harness or behaviour)."""
    import compat

    if result["ok"]:
        return
    message = f"rank {rank}: {result['error']}\n" + "".join(result.get("where", []))
    if result.get("error_kind") == "harness":
        raise compat.HarnessError(message)
    raise compat.BehaviourFailure(message)
