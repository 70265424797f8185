"""Tests for ``flashmla-sparse-dcp.patch``: FlashMLA sparse MLA under decode context parallelism.

CPU part (CI): real vLLM objects (``VllmConfig`` from a local GLM-5 ``config.json``,
``FlashMLASparseImpl``, its metadata builder, ``MLADCPManager``, the DCP compatibility check)
with only GPU-only pieces replaced at their call boundary: the DCP/TP process groups (a
hashable stand-in with ``world_size``/``rank_in_group``), the CUDA SM-count query, the Triton
index-conversion kernels (the DCP = 1 conversion and the DCP localization, by torch stand-ins in
``flashmla_standins``; the localization's is held to a plain-Python model of the layout here and
to the Triton kernel on GPUs) and the compiled FlashMLA decode kernel (by a float32
implementation of its documented contract: natural-log LSE, +inf LSE and zero output for a query
with no valid index).

GPU part (``-m gpu``, ``OVERLAY_DCP_RANKS`` GPUs, default 2): vLLM 0.28.0's compiled FlashMLA
kernels, NCCL, vLLM's own DCP combines (ag_rs and a2a); see
``test_gpu_dcp_decode_matches_single_gpu``.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import compat
import pytest
import sparse_dcp_harness as h
import torch
from flashmla_standins import (
    D_QK,
    D_V,
    cpu_kernels,
    dequantize_fp8_ds_mla,
    localize_standin,
    quantize_fp8_ds_mla,
    sparse_decode_contract,
)
from ranks import free_port, gpu_ranks

NUM_HEADS_TOTAL = 16  # heads the MQA kernel sees after the DCP query all-gather
TOPK = 256  # index_topk of the test model (a multiple of the Triton tile, 128)
BLOCK = 64  # kernel block size of FlashMLA sparse

GLM5_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": NUM_HEADS_TOTAL,
    "num_key_value_heads": NUM_HEADS_TOTAL,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "index_topk": TOPK,
    "index_head_dim": 128,
    "index_n_heads": 4,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "rope_theta": 10000,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5,
}


# --------------------------------------------------------------------------------------------
# Plain-Python reference of the DCP KV layout
# --------------------------------------------------------------------------------------------
def py_localize(
    req_ids: list[int],
    block_table: list[list[int]],
    rows: list[list[int]],
    dcp: int,
    rank: int,
    interleave: int,
    block: int,
) -> tuple[list[list[int]], list[int]]:
    """Global position -> this rank's physical slot, element by element, -1 if not local."""
    out, counts = [], []
    for req, row in zip(req_ids, rows, strict=True):
        new = []
        for t in row:
            slot = -1
            if t >= 0 and (t // interleave) % dcp == rank:
                local = (t // (dcp * interleave)) * interleave + t % interleave
                if local // block < len(block_table[req]):
                    slot = block_table[req][local // block] * block + local % block
            new.append(slot)
        out.append(new)
        counts.append(sum(s >= 0 for s in new))
    return out, counts


# --------------------------------------------------------------------------------------------
# Batches: requests, their top-k rows, and the caches of every layout
# --------------------------------------------------------------------------------------------
@dataclass
class Batch:
    """One step: per-request context lengths and query lengths, and the global top-k rows."""

    seq_lens: list[int]
    query_lens: list[int]
    topk: torch.Tensor  # [T, TOPK] int32 global positions, -1 padded
    req_ids: list[int]


def query_positions(seq_lens: list[int], query_lens: list[int]) -> list[tuple[int, int]]:
    return [(r, s - q + i) for r, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True))
            for i in range(q)]


def make_batch(kind: str, interleave: int, dcp: int, rng: random.Random) -> Batch:
    """The GPU/CPU end-to-end cases of the issue."""
    if kind == "decode":
        seq_lens, query_lens = [rng.randint(200, 1500) for _ in range(4)] + [37], [1] * 5
    elif kind in ("mtp6", "mtp11"):
        q = 6 if kind == "mtp6" else 11
        seq_lens, query_lens = [rng.randint(300, 1200) for _ in range(3)], [q] * 3
    elif kind == "mixed":
        seq_lens = [rng.randint(300, 900), rng.randint(300, 900), 600, 90]
        query_lens = [1, 1, 40, 90]  # two decodes, a chunked prefill, a fresh prefill
    elif kind in ("one_rank", "empty_rows"):
        seq_lens, query_lens = [rng.randint(400, 1000) for _ in range(3)], [2, 2, 2]
    else:
        raise ValueError(kind)
    rows, req_ids = [], []
    for i, (r, pos) in enumerate(query_positions(seq_lens, query_lens)):
        cand = list(range(pos + 1))
        if kind == "one_rank":  # every index on rank 1 (rank 0 gets nothing)
            cand = [t for t in cand if (t // interleave) % dcp == 1]
        if kind == "empty_rows" and i % 3 == 0:
            cand = []  # a padding row: no index at all
        elif kind == "empty_rows" and i % 3 == 1:
            cand = [t for t in cand if (t // interleave) % dcp == 0][:5]  # few, rank 0 only
        picked = rng.sample(cand, min(TOPK, len(cand)))
        row = picked + [-1] * (TOPK - len(picked))
        rng.shuffle(row)
        rows.append(row)
        req_ids.append(r)
    return Batch(seq_lens, query_lens, torch.tensor(rows, dtype=torch.int32), req_ids)


def build_caches(
    batch: Batch, dcp: int, interleave: int, gen: torch.Generator, device: str
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Random token KV rows laid out (a) whole, one GPU; (b) split the DCP way.

    Returns (kv float [R, maxlen, 576], whole cache, per-rank caches, whole block table,
    DCP block table). Each rank uses the same block table row for a request; its blocks
    hold only the tokens it owns, at their local positions.
    """
    n_req, max_len = len(batch.seq_lens), max(batch.seq_lens)
    kv = torch.randn((n_req, max_len, D_QK), generator=gen) * 0.5
    raw = quantize_fp8_ds_mla(kv.view(-1, D_QK)).view(n_req, max_len, 656)

    whole_blocks = math.ceil(max_len / BLOCK)
    perm = torch.randperm(n_req * whole_blocks + 3, generator=gen)[: n_req * whole_blocks] + 1
    whole_table = perm.view(n_req, whole_blocks).to(torch.int32)
    whole = torch.zeros((n_req * whole_blocks + 4, BLOCK, 656), dtype=torch.uint8)

    local_blocks = math.ceil(math.ceil(max_len / (dcp * interleave)) * interleave / BLOCK)
    perm = torch.randperm(n_req * local_blocks + 3, generator=gen)[: n_req * local_blocks] + 1
    dcp_table = perm.view(n_req, local_blocks).to(torch.int32)
    shards = [torch.zeros((n_req * local_blocks + 4, BLOCK, 656), dtype=torch.uint8)
              for _ in range(dcp)]
    for r, seq_len in enumerate(batch.seq_lens):
        for t in range(seq_len):
            whole[whole_table[r, t // BLOCK], t % BLOCK] = raw[r, t]
            owner = (t // interleave) % dcp
            local = (t // (dcp * interleave)) * interleave + t % interleave
            shards[owner][dcp_table[r, local // BLOCK], local % BLOCK] = raw[r, t]
    to = [whole.to(device), *(s.to(device) for s in shards)]
    return kv, to[0], to[1:], whole_table.to(device), dcp_table.to(device)


# --------------------------------------------------------------------------------------------
# vLLM objects
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StandInGroup:
    """The DCP/TP group as the code under test sees it outside collectives."""

    world_size: int
    rank_in_group: int


def write_model_dir(root: Path, num_heads: int = NUM_HEADS_TOTAL, mtp_layers: int = 0) -> Path:
    """The test model's ``config.json`` in ``root``, with ``num_heads`` attention heads in all
    and ``mtp_layers`` MTP (next-n prediction) layers."""
    root.mkdir(parents=True, exist_ok=True)
    config = {**GLM5_CONFIG, "num_attention_heads": num_heads, "num_key_value_heads": num_heads}
    if mtp_layers:
        config["num_nextn_predict_layers"] = mtp_layers
    (root / "config.json").write_text(json.dumps(config))
    return root


def make_vllm_config(model_dir: Path, dcp: int, interleave: int, backend: str = "ag_rs",
                     device: str = "cpu", cache_dtype: str = "fp8_ds_mla", mtp: int = 0,
                     tp: int | None = None) -> Any:
    """A real VllmConfig at TP ``tp`` (default ``dcp``) x DCP ``dcp``; ``mtp`` > 0 adds vLLM's own
    MTP ``SpeculativeConfig`` with that many speculative tokens (sequential drafting), for a model
    dir written with ``mtp_layers=1``."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    with compat.setup("the VllmConfig of the test model"):
        model = ModelConfig(model=str(model_dir), tokenizer=None, skip_tokenizer_init=True,
                            dtype="bfloat16", max_model_len=8192)
        parallel = ParallelConfig(tensor_parallel_size=tp or dcp, decode_context_parallel_size=dcp,
                                  cp_kv_cache_interleave_size=interleave, dcp_comm_backend=backend)
        cache = CacheConfig(cache_dtype=cache_dtype, block_size=BLOCK)
        spec = (SpeculativeConfig(method="mtp", num_speculative_tokens=mtp, target_model_config=model,
                                  target_parallel_config=parallel) if mtp else None)
        return VllmConfig(model_config=model, parallel_config=parallel, cache_config=cache,
                          device_config=DeviceConfig(device=device), speculative_config=spec)


def make_impl(vllm_config: Any, num_heads: int, topk_buffer: torch.Tensor,
              cache_dtype: str = "fp8_ds_mla") -> Any:
    from vllm.config import set_current_vllm_config

    impl_cls = compat.symbol("flashmla_sparse", "FlashMLASparseImpl")
    with set_current_vllm_config(vllm_config):
        return impl_cls(
            num_heads=num_heads, head_size=D_QK, scale=D_QK**-0.5, num_kv_heads=1,
            alibi_slopes=None, sliding_window=None, kv_cache_dtype=cache_dtype,
            logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None,
            topk_indices_buffer=topk_buffer, q_lora_rank=64, kv_lora_rank=512,
            qk_nope_head_dim=64, qk_rope_head_dim=64, qk_head_dim=128, v_head_dim=64,
            kv_b_proj=None,
        )


def fp8_padded_heads(impl: Any) -> int:
    """The heads FlashMLA's sparse FP8 decode kernel runs for ``impl`` (the DCP-gathered heads padded to
    64 or 128): the impl's own attribute up to 0.33.0; 0.34.0 pads per call, from the heads the DCP
    query all-gather hands it (``_compute_fp8_decode_padded_heads``)."""
    if hasattr(impl, "fp8_decode_padded_heads"):
        return impl.fp8_decode_padded_heads
    return impl._compute_fp8_decode_padded_heads(impl.num_heads * max(impl.dcp_world_size, 1))


def make_manager(vllm_config: Any, impl: Any, heads: int, device: str = "cpu") -> Any:
    """vLLM's ``MLADCPManager`` for ``impl`` (``heads`` per rank), built under ``vllm_config``."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        return compat.symbol("dcp", "MLADCPManager")(
            vllm_config, torch.device(device), heads, D_QK, D_V, torch.bfloat16, torch.bfloat16, None,
            impl.lse_base_on_e, False)


def make_layer(impl: Any, dcp_manager: Any = None) -> Any:
    """A registered attention layer holding ``impl`` (what ``MLAAttention`` exposes)."""
    base = compat.symbol("attention_layer_base", "AttentionLayerBase")
    backend = compat.symbol("flashmla_sparse", "FlashMLASparseBackend")

    class Layer(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            self.impl = impl
            self.prefill_backend = None
            self.dcp_manager = dcp_manager

        def get_attn_backend(self) -> Any:
            return backend

        def get_kv_cache_spec(self, vllm_config: Any) -> Any:
            raise NotImplementedError

    return Layer()


def build_metadata(vllm_config: Any, layer: Any, batch: Batch, block_table: torch.Tensor,
                   device: str) -> Any:
    """Run the real ``FlashMLASparseMetadataBuilder`` on a ``CommonAttentionMetadata``."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    name = "model.layers.0.self_attn.attn"
    vllm_config.compilation_config.static_forward_context[name] = layer
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=D_QK,
                            dtype=torch.uint8, cache_dtype_str="fp8_ds_mla")
    builder_cls = compat.symbol("flashmla_sparse", "FlashMLASparseMetadataBuilder")
    builder = builder_cls(spec, [name], vllm_config, torch.device(device))
    qsl = torch.tensor([0, *torch.tensor(batch.query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
    common = h.common_attention_metadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq_lens.to(device),
        num_reqs=len(batch.seq_lens), num_actual_tokens=int(qsl[-1]),
        max_query_len=max(batch.query_lens), max_seq_len=max(batch.seq_lens),
        block_table_tensor=block_table,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=seq_lens, _seq_lens_cpu=seq_lens,
    )
    return builder.build(0, common)


# --------------------------------------------------------------------------------------------
# CPU fixtures
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("glm5"))


@pytest.fixture
def cpu_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Stand-in process groups; the CUDA-only calls the constructors make, replaced."""
    import vllm.distributed.parallel_state as ps
    from vllm.v1.worker import workspace

    fs = compat.module("flashmla_sparse")
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    h.no_pinned_memory(monkeypatch.setattr)  # page-locking needs CUDA
    monkeypatch.setattr(fs, "num_compute_units", lambda index=None: 132)
    monkeypatch.setattr(fs, "torch", h.UnpinnedTorch())  # 0.29.0+: a literal pin_memory=True
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device("cpu"))

    def set_groups(dcp: int, rank: int) -> None:
        for attr in ("_DCP", "_TP"):
            monkeypatch.setattr(ps, attr, StandInGroup(dcp, rank))
        monkeypatch.setattr(ps, "_PCP", StandInGroup(1, 0))

    return set_groups


# --------------------------------------------------------------------------------------------
# CPU tests
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("interleave", [1, 16])
def test_cp_compatibility_check_accepts_flashmla_sparse_with_dcp(
    model_dir: Path, cpu_env: Any, interleave: int
) -> None:
    """vllm/v1/worker/cp_utils.py refuses a backend that returns no decode LSE under DCP."""
    cpu_env(2, 1)
    vc = make_vllm_config(model_dir, dcp=2, interleave=interleave)
    impl = make_impl(vc, NUM_HEADS_TOTAL // 2, torch.full((64, TOPK), -1, dtype=torch.int32))
    vc.compilation_config.static_forward_context["model.layers.0.self_attn.attn"] = make_layer(impl)
    compat.symbol("cp_utils", "check_attention_cp_compatibility")(vc)  # raises on the base
    assert impl.need_to_return_lse_for_decode
    assert impl.lse_base_on_e, "FlashMLA's sparse kernels return a natural-log LSE"
    # Per-token index localization handles MTP queries with any interleave size.
    assert impl.supports_mtp_with_cp_non_trivial_interleave_size


def test_dcp1_impl_is_unchanged(model_dir: Path, cpu_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without DCP: no LSE requested, none returned, the original kernel path and heads."""
    cpu_env(1, 0)
    cpu_kernels(monkeypatch)
    vc = make_vllm_config(model_dir, dcp=1, interleave=1)
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    batch = make_batch("mixed", 1, 1, rng)
    _, whole, _, whole_table, _ = build_caches(batch, 1, 1, gen, "cpu")
    buf = torch.full((256, TOPK), -1, dtype=torch.int32)
    buf[: batch.topk.shape[0]] = batch.topk
    impl = make_impl(vc, NUM_HEADS_TOTAL, buf)
    assert not impl.need_to_return_lse_for_decode
    assert fp8_padded_heads(impl) == 64
    meta = build_metadata(vc, make_layer(impl), batch, whole_table, "cpu")
    assert meta.fp8_use_mixed_batch  # 16 heads < MIN_HEADS_FOR_BF16_PREFILL, as before
    q = torch.randn((batch.topk.shape[0], NUM_HEADS_TOTAL, D_QK), generator=gen).bfloat16()
    out, lse = impl.forward_mqa(q, whole, meta, None)
    assert lse is None and out.shape == (q.shape[0], NUM_HEADS_TOTAL, D_V)
    # Same kernel input as before: global slots of the whole cache, all tokens in one batch.
    slots = convert_whole(batch, whole_table)
    want, _ = sparse_decode_contract(q.unsqueeze(0), dequantize_fp8_ds_mla(whole.view(-1, 656)),
                                     slots.unsqueeze(0), D_QK**-0.5)
    assert torch.equal(out, want.squeeze(0))


def test_dcp_refuses_more_gathered_heads_than_the_kernel_takes(model_dir: Path, cpu_env: Any) -> None:
    """The DCP query all-gather hands the sparse FP8 decode kernel every rank's heads, and it takes
    64 or 128: beyond 128 the impl refuses to start, in one line naming the numbers."""
    cpu_env(2, 0)
    vc = make_vllm_config(model_dir, dcp=2, interleave=1)
    buf = torch.full((64, TOPK), -1, dtype=torch.int32)
    with pytest.raises(NotImplementedError) as refused:
        make_impl(vc, 128, buf)
    message = str(refused.value)
    assert "\n" not in message
    assert re.search(r"at most 128 heads.* 256 \(128 heads per rank x DCP size 2\)", message), message
    assert fp8_padded_heads(make_impl(vc, 64, buf)) == 128  # 128 gathered: the limit


# GLM-5's attention heads (num_attention_heads of its config.json) and the TP x DCP layouts it is
# served with: TP8 x DCP8 and TP8 x DCP4 (overlay/regress/profiles), and TP2 x DCP2 on two GPUs.
GLM5_HEADS = 64


@pytest.mark.parametrize(("tp", "dcp"), [(8, 8), (8, 4), (2, 2)])
def test_glm5_layouts_stay_within_the_kernel_heads(tmp_path: Path, cpu_env: Any, tp: int, dcp: int) -> None:
    """GLM-5's heads per rank, as vLLM's config divides them at TP ``tp``, gathered over DCP ``dcp``:
    at most 64, one kernel head block."""
    cpu_env(dcp, 0)
    vc = make_vllm_config(write_model_dir(tmp_path, num_heads=GLM5_HEADS), dcp=dcp, interleave=1, tp=tp)
    heads = vc.model_config.get_num_attention_heads(vc.parallel_config)
    assert heads == GLM5_HEADS // tp
    impl = make_impl(vc, heads, torch.full((64, TOPK), -1, dtype=torch.int32))
    assert fp8_padded_heads(impl) == 64


@pytest.mark.parametrize("cache_dtype", ["auto", "bfloat16"])
def test_dcp_refuses_a_bf16_cache(model_dir: Path, cpu_env: Any, cache_dtype: str) -> None:
    """The BF16 cache's sparse path has no DCP support: under DCP the impl refuses it at start-up,
    in one line, as later vLLM releases do; without DCP it is built as before."""
    buf = torch.full((64, TOPK), -1, dtype=torch.int32)
    cpu_env(1, 0)
    make_impl(make_vllm_config(model_dir, dcp=1, interleave=1, cache_dtype=cache_dtype), NUM_HEADS_TOTAL, buf,
              cache_dtype=cache_dtype)
    cpu_env(2, 0)
    vc = make_vllm_config(model_dir, dcp=2, interleave=1, cache_dtype=cache_dtype)
    with pytest.raises(NotImplementedError) as refused:
        make_impl(vc, NUM_HEADS_TOTAL // 2, buf, cache_dtype=cache_dtype)
    message = str(refused.value)
    assert "\n" not in message and "requires an fp8_ds_mla kv-cache" in message and cache_dtype in message


MTP_TOKENS = 5  # MTP-5, production's setting: (1 + 5)-token verification steps


@pytest.fixture(scope="module")
def mtp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("glm5-mtp"), mtp_layers=1)


def _split(vllm_config: Any, dcp: int, query_lens: list[int], seq_lens: list[int]) -> Any:
    """The real FlashMLA-sparse builder (rank 0 of ``dcp``) and its metadata for one batch."""
    topk = torch.full((256, TOPK), -1, dtype=torch.int32)
    impl = make_impl(vllm_config, NUM_HEADS_TOTAL // dcp, topk)
    manager = make_manager(vllm_config, impl, NUM_HEADS_TOTAL // dcp) if dcp > 1 else None
    batch = Batch(seq_lens, query_lens, torch.zeros((sum(query_lens), TOPK), dtype=torch.int32),
                  [r for r, q in enumerate(query_lens) for _ in range(q)])
    blocks = math.ceil(max(seq_lens) / BLOCK)
    table = torch.arange(len(seq_lens) * blocks, dtype=torch.int32).view(len(seq_lens), blocks)
    return build_metadata(vllm_config, make_layer(impl, manager), batch, table, "cpu")


@pytest.mark.parametrize(("dcp", "interleave", "mtp_decodes"), [
    (2, 1, True),    # TP2 x DCP2: MTP steps stay decodes (supports_dcp_with_varlen)
    (2, 16, False),  # interleave > 1: the threshold drops to 1, MTP steps are prefills
    (1, 1, True),    # no DCP: unchanged
])
def test_mtp_verification_steps_under_dcp(mtp_model_dir: Path, cpu_env: Any, monkeypatch: pytest.MonkeyPatch,
                                          dcp: int, interleave: int, mtp_decodes: bool) -> None:
    """The split of a uniform (1 + 5)-token MTP batch: all decodes, or (interleave > 1) all prefills."""
    cpu_kernels(monkeypatch)
    cpu_env(dcp, 0)
    vc = make_vllm_config(mtp_model_dir, dcp=dcp, interleave=interleave, mtp=MTP_TOKENS)
    q = 1 + MTP_TOKENS
    meta = _split(vc, dcp, [q] * 4, [300, 1200, 57, 700])
    if mtp_decodes:
        assert (meta.num_decodes, meta.num_prefills, meta.num_decode_tokens) == (4, 0, 4 * q)
    else:
        assert (meta.num_decodes, meta.num_prefills, meta.num_decode_tokens) == (0, 4, 0)


@pytest.mark.parametrize("interleave", [1, 16])
def test_builder_reorder_threshold_with_mtp(mtp_model_dir: Path, cpu_env: Any, monkeypatch: pytest.MonkeyPatch,
                                            interleave: int) -> None:
    """TP2 x DCP2 with MTP-5: the threshold covers 1 + 5 tokens with interleave 1, else 1."""
    cpu_kernels(monkeypatch)
    cpu_env(2, 0)
    vc = make_vllm_config(mtp_model_dir, dcp=2, interleave=interleave, mtp=MTP_TOKENS)
    seen: list[int] = []
    builder_cls = compat.symbol("flashmla_sparse", "FlashMLASparseMetadataBuilder")
    build = builder_cls.build

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(self.reorder_batch_threshold)
        return build(self, *args, **kwargs)

    monkeypatch.setattr(builder_cls, "build", spy)
    _split(vc, 2, [1], [10])
    if interleave == 1:
        assert seen[0] >= 1 + MTP_TOKENS
    else:
        assert seen == [1]


def test_mtp_step_beside_a_long_prefill_keeps_the_prefill(mtp_model_dir: Path, cpu_env: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With MTP steps as decodes, a prefill chunk beyond the threshold is still a prefill: the
    forced-MQA prefill path (and the bounds dcp-forced-mqa-prefill-rows gives it) stays in use."""
    cpu_kernels(monkeypatch)
    cpu_env(2, 0)
    vc = make_vllm_config(mtp_model_dir, dcp=2, interleave=1, mtp=MTP_TOKENS)
    q = 1 + MTP_TOKENS
    meta = _split(vc, 2, [q, q, q, 2000], [400, 90, 800, 3000])
    # The prefill's context (3000) is beyond index_topk (256), so forward_impl sends its rows
    # through the forced-MQA path, not the dense MHA prefill.
    assert (meta.num_decodes, meta.num_prefills, meta.num_decode_tokens) == (3, 1, 3 * q)
    assert 3000 > meta.topk_tokens


def convert_whole(batch: Batch, table: torch.Tensor) -> torch.Tensor:
    """Global positions -> slots of the single-GPU cache (plain Python)."""
    rows = [[int(table[r, t // BLOCK]) * BLOCK + t % BLOCK if t >= 0 else -1 for t in row]
            for r, row in zip(batch.req_ids, batch.topk.tolist(), strict=True)]
    return torch.tensor(rows, dtype=torch.int32)


def test_localize_standin_matches_python_reference() -> None:
    """The stand-in of the Triton localization the forward tests run (``localize_standin``, as the
    patch calls it: no compaction, valid counts): global top-k positions -> rank-local slots,
    against a plain-Python model of the DCP KV layout, random cases. ``-m gpu`` holds it to the
    Triton kernel itself."""
    rng = random.Random(0)
    n_cases = 0
    for dcp in (2, 4, 8):
        for interleave in (1, 2, 4, 16, 64):
            for _case in range(6):
                n_req = rng.randint(1, 5)
                seq_lens = [rng.randint(1, 3000) for _ in range(n_req)]
                blocks = math.ceil(max(seq_lens) / (dcp * interleave)) * interleave // BLOCK + 1
                # Sometimes a block table too short for the sequence: the tail must mask.
                blocks = max(1, blocks - rng.randint(0, 1))
                table = [[rng.randint(0, 10_000) for _ in range(blocks)] for _ in range(n_req)]
                k = rng.choice([128, 256])
                req_ids, rows = [], []
                for r, s in enumerate(seq_lens):
                    q_len = rng.choice([1, 1, 4, 6, 11, 40])  # decode, MTP 1+k / 1+2k, prefill
                    for i in range(min(q_len, s)):
                        pos = s - min(q_len, s) + i
                        cand = list(range(pos + 1))
                        mode = rng.random()
                        if mode < 0.15:
                            cand = []  # empty row
                        elif mode < 0.35:
                            owner = rng.randrange(dcp)  # all top-k on one rank
                            cand = [t for t in cand if (t // interleave) % dcp == owner]
                        picked = rng.sample(cand, min(k, len(cand)))
                        row = picked + [-1] * (k - len(picked))
                        rng.shuffle(row)
                        req_ids.append(r)
                        rows.append(row)
                total_valid = [0] * len(rows)
                for rank in range(dcp):
                    got, counts = localize_standin(
                        torch.tensor(req_ids, dtype=torch.int32),
                        torch.tensor(table, dtype=torch.int32),
                        torch.tensor(rows, dtype=torch.int32),
                        dcp_size=dcp, dcp_rank=rank, cp_kv_cache_interleave_size=interleave,
                        BLOCK_SIZE=BLOCK, NUM_TOPK_TOKENS=k, return_valid_counts=True,
                        compact_valid_to_front=False,
                    )
                    want, want_counts = py_localize(req_ids, table, rows, dcp, rank, interleave,
                                                    BLOCK)
                    assert got.dtype == torch.int32 and counts.dtype == torch.int32
                    assert got.tolist() == want, (dcp, interleave, rank)
                    assert counts.tolist() == want_counts
                    total_valid = [a + b for a, b in zip(total_valid, want_counts, strict=True)]
                    n_cases += 1
                # Each in-table position is owned by exactly one rank.
                for row, r, tot in zip(rows, req_ids, total_valid, strict=True):
                    in_table = sum(1 for t in row if t >= 0 and
                                   ((t // (dcp * interleave)) * interleave + t % interleave)
                                   // BLOCK < len(table[r]))
                    assert tot == in_table
    assert n_cases == 5 * 6 * (2 + 4 + 8)


CPU_CASES = ["decode", "mtp6", "mtp11", "mixed", "one_rank", "empty_rows"]


@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("kind", CPU_CASES)
def test_dcp_forward_merges_to_single_rank_result(
    model_dir: Path, cpu_env: Any, monkeypatch: pytest.MonkeyPatch, kind: str, interleave: int
) -> None:
    """Two DCP ranks' forward_mqa (patched) merged by LSE == one rank over the whole cache."""
    cpu_kernels(monkeypatch)
    dcp = 2
    rng, gen = random.Random(hash((kind, interleave)) % 1000), torch.Generator().manual_seed(7)
    batch = make_batch(kind, interleave, dcp, rng)
    _, whole, shards, whole_table, dcp_table = build_caches(batch, dcp, interleave, gen, "cpu")
    n_tok = batch.topk.shape[0]
    q = torch.randn((n_tok, NUM_HEADS_TOTAL, D_QK), generator=gen).bfloat16()

    def buffer() -> torch.Tensor:
        buf = torch.full((256, TOPK), -1, dtype=torch.int32)
        buf[:n_tok] = batch.topk
        return buf

    cpu_env(1, 0)
    vc1 = make_vllm_config(model_dir, dcp=1, interleave=1)
    ref_impl = make_impl(vc1, NUM_HEADS_TOTAL, buffer())
    ref_meta = build_metadata(vc1, make_layer(ref_impl), batch, whole_table, "cpu")
    ref_out, _ = ref_impl.forward_mqa(q, whole, ref_meta, None)

    outs, lses = [], []
    for rank in range(dcp):
        cpu_env(dcp, rank)
        vc = make_vllm_config(model_dir, dcp=dcp, interleave=interleave)
        impl = make_impl(vc, NUM_HEADS_TOTAL // dcp, buffer())
        assert fp8_padded_heads(impl) == 64
        manager = make_manager(vc, impl, NUM_HEADS_TOTAL // dcp)
        meta = build_metadata(vc, make_layer(impl, manager), batch, dcp_table, "cpu")
        assert meta.fp8_use_mixed_batch
        out, lse = impl.forward_mqa(q, shards[rank], meta, None)
        assert lse is not None, "DCP needs the decode LSE"
        assert out.shape == (n_tok, NUM_HEADS_TOTAL, D_V)
        assert lse.shape == (n_tok, NUM_HEADS_TOTAL) and lse.dtype == torch.float32
        owned = [(t >= 0) & ((t // interleave) % dcp == rank) for t in batch.topk.long()]
        empty = torch.stack([~o.any() for o in owned])
        assert torch.isneginf(lse[empty]).all(), "rows with no local index carry no weight"
        assert (out[empty] == 0).all()
        assert torch.isfinite(lse[~empty]).all()
        outs.append(out)
        lses.append(lse)
        base_e = impl.lse_base_on_e

    combine = compat.symbol("dcp_alltoall", "_lse_weighted_combine")
    merged = combine(torch.stack(outs).float(), torch.stack(lses), is_lse_base_on_e=base_e)
    # Each rank's partial output is bf16 (2^-9 relative rounding), the reference once.
    torch.testing.assert_close(merged, ref_out.float(), atol=2e-2, rtol=2e-2)
    if kind == "one_rank":
        torch.testing.assert_close(outs[1], ref_out, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------
# GPU: OVERLAY_DCP_RANKS ranks (default 2), vLLM's compiled FlashMLA kernels, NCCL and vLLM's
# DCP combines. Heads per rank are fixed (8); the model has world * 8 heads (TP = DCP = world).
# --------------------------------------------------------------------------------------------
GPU_HEADS_PER_RANK = NUM_HEADS_TOTAL // 2
GPU_CASES = ["decode", "mtp6", "mtp11", "mixed", "one_rank", "empty_rows"]
GPU_INTERLEAVES = [1, 16]
# Merged vs single-GPU output: each rank's partial output is rounded to bf16 (relative 2^-9),
# the merged output again, the single-GPU output once, and the kernel rounds its softmax
# probabilities to bf16 before P @ V relative to a per-shard (not global) running max. With
# |O| <~ 1.5 here that bounds the difference near 3 * 2^-9 * 1.5 ~ 9e-3; 2e-2 leaves margin
# while a wrong LSE base or a misplaced index gives errors of order |O| (0.1 - 1).
GPU_ATOL = 2e-2


def _gpu_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                      NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    from functools import partial

    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_dcp_group, init_distributed_environment, initialize_model_parallel
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens
    from vllm.v1.worker.workspace import init_workspace_manager

    fs = compat.module("flashmla_sparse")
    a2a_nccl = compat.symbol("dcp_alltoall", "dcp_a2a_lse_reduce")
    triton_filter = compat.symbol("sparse_utils", "triton_filter_and_convert_dcp_index")

    vc0 = make_vllm_config(Path(model_dir), dcp=world, interleave=1, device="cuda")
    with set_current_vllm_config(vc0):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     backend="nccl")
        initialize_model_parallel(tensor_model_parallel_size=world,
                                  decode_context_model_parallel_size=world)
    init_workspace_manager(torch.device(device))
    heads = GPU_HEADS_PER_RANK
    total = world * heads
    mine = slice(rank * heads, (rank + 1) * heads)
    results: list[dict[str, Any]] = []
    for interleave in GPU_INTERLEAVES:
        vcs = {b: make_vllm_config(Path(model_dir), dcp=world, interleave=interleave,
                                   backend=b, device="cuda") for b in ("ag_rs", "a2a")}
        buf = torch.full((512, TOPK), -1, dtype=torch.int32, device=device)
        impl = make_impl(vcs["ag_rs"], heads, buf)
        managers = {b: make_manager(vc, impl, heads, device) for b, vc in vcs.items()}
        combines = {
            "ag_rs": managers["ag_rs"].combine,
            "a2a": managers["a2a"].combine,  # direct symmetric-memory A2A when available
            "a2a_nccl": partial(a2a_nccl, cp_group=get_dcp_group(),
                                is_lse_base_on_e=impl.lse_base_on_e),
        }
        for kind in GPU_CASES:
            rng = random.Random(1000 * interleave + GPU_CASES.index(kind))
            gen = torch.Generator().manual_seed(17 + interleave)
            batch = make_batch(kind, interleave, world, rng)
            _, whole, shards, whole_table, dcp_table = build_caches(batch, world, interleave,
                                                                    gen, device)
            n_tok = batch.topk.shape[0]
            q = (torch.randn((n_tok, total, D_QK), generator=gen)).bfloat16().to(device)
            buf.fill_(-1)
            buf[:n_tok] = batch.topk.to(device)
            with set_current_vllm_config(vcs["ag_rs"]):
                meta = build_metadata(vcs["ag_rs"], make_layer(impl, managers["ag_rs"]), batch,
                                      dcp_table, device)
                out, lse = impl.forward_mqa(q, shards[rank], meta, None)
            # The Triton localization equals the CPU tests' stand-in of it on the same rows.
            args = (meta.req_id_per_token[:n_tok], dcp_table, batch.topk.to(device))
            how = dict(dcp_size=world, dcp_rank=rank, cp_kv_cache_interleave_size=interleave,
                       BLOCK_SIZE=BLOCK, NUM_TOPK_TOKENS=TOPK, return_valid_counts=True,
                       compact_valid_to_front=False)
            tri = triton_filter(*args, **how)
            ref_loc = localize_standin(*(a.cpu() for a in args), **how)
            loc_equal = bool(torch.equal(tri[0].cpu(), ref_loc[0])
                             and torch.equal(tri[1].cpu(), ref_loc[1]))
            # Single-GPU sparse decode over the whole cache (the DCP = 1 kernel call).
            slots = convert_whole(batch, whole_table.cpu()).to(device)
            sched, _ = fs.get_mla_metadata()
            ref_meta = fs.FlashMLASparseMetadata.FP8KernelMetadata(
                scheduler_metadata=sched, dummy_block_table=meta.fp8_extra_metadata.dummy_block_table,
                cache_lens=meta.fp8_extra_metadata.cache_lens)
            ref_out, ref_lse = impl._fp8_flash_mla_kernel(q.unsqueeze(0), whole,
                                                         slots.unsqueeze(0), ref_meta)
            ref_out = ref_out.squeeze(0).float()
            ref_lse = ref_lse[0, :total].transpose(0, 1)
            # The kernel's LSE against torch.logsumexp in float32 (natural log).
            _, contract_lse = sparse_decode_contract(
                q.unsqueeze(0).cpu(), dequantize_fp8_ds_mla(whole.view(-1, 656).cpu()),
                slots.unsqueeze(0).cpu(), D_QK**-0.5)
            contract_lse = contract_lse[0].transpose(0, 1)
            has_any = torch.isfinite(contract_lse)
            lse_err = (ref_lse.cpu()[has_any] - contract_lse[has_any]).abs().max().item()
            seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32, device=device)
            local_lens = get_dcp_local_seq_lens(seq_lens, world, rank, interleave)
            qsl = meta.query_start_loc
            row = {"rank": rank, "interleave": interleave, "kind": kind, "tokens": n_tok,
                   "loc_equal": loc_equal, "kernel_lse_vs_logsumexp": lse_err,
                   "empty_rows_here": int((lse == float("-inf")).all(1).sum())}
            for name, combine in combines.items():
                merged = combine(out.clone(), lse.clone(), seq_lens=local_lens,
                                 query_start_loc=qsl)
                torch.cuda.synchronize()
                want = ref_out[:, mine]
                none_valid = ~torch.isfinite(ref_lse[:, mine]).any(1)  # rows with no index
                want = want.masked_fill(none_valid[:, None, None], 0.0)
                err = (merged.float() - want).abs()
                row[name] = err.max().item()
                row[name + "_nan"] = bool(torch.isnan(merged).any())
            results.append(row)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.gpu
def test_gpu_dcp_decode_matches_single_gpu(tmp_path: Path) -> None:
    """Split a random fp8_ds_mla cache across ``OVERLAY_DCP_RANKS`` GPUs (default 2) the DCP way,
    run the patched decode on each rank, merge with each DCP combine (ag_rs; a2a direct and
    NCCL) and compare with one GPU decoding over the whole cache."""
    import torch.multiprocessing as mp

    world = gpu_ranks()
    model = write_model_dir(tmp_path / "glm5", num_heads=world * GPU_HEADS_PER_RANK)
    mp.spawn(_gpu_worker, args=(world, free_port(), str(model), str(tmp_path)), nprocs=world, join=True)
    rows = [r for k in range(world) for r in json.loads((tmp_path / f"rank{k}.json").read_text())]
    report = os.environ.get("FLASHMLA_DCP_GPU_REPORT")
    if report:
        Path(report).write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(json.dumps(r))
    for r in rows:
        assert r["loc_equal"], r
        assert r["kernel_lse_vs_logsumexp"] < 1e-2, r  # natural log (base 2 would be ~30% off)
        for name in ("ag_rs", "a2a", "a2a_nccl"):
            assert not r[name + "_nan"], r
            assert r[name] < GPU_ATOL, r
