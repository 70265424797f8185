"""The compiled and Triton kernels of vLLM's FlashMLA-sparse backend, in torch, for CPU runs.

- the fp8_ds_mla cache row (656 bytes: 512 fp8 e4m3 NoPE, 4 fp32 tile scales, 64 bf16 RoPE):
  :func:`quantize_fp8_ds_mla` writes what vLLM's cache kernel writes, :func:`dequantize_fp8_ds_mla`
  reads it back;
- :func:`sparse_decode_contract`: FlashMLA's sparse fp8 decode (``flash_mla_with_kvcache`` with
  ``indices``) as documented: natural-log LSE, +inf LSE and zero output for a query with no valid
  index;
- :func:`localize_standin`: ``triton_filter_and_convert_dcp_index`` (global top-k positions to this
  DCP rank's slots); :func:`neutralize_dcp_empty_rows_standin`: 0.34.0's ``neutralize_dcp_empty_rows_``;
- :func:`cpu_kernels` installs them (and the DCP 1 index conversion, the scheduler metadata) at
  their call boundary in the backend module.

Shared by ``test_flashmla_sparse_dcp.py`` and the GLM-5 path harness (``glm5_path.py``).
"""

from __future__ import annotations

from typing import Any

import compat
import pytest
import sparse_dcp_harness as h
import torch

D_QK, D_V = 576, 512  # FlashMLA's sparse MLA head dims (kv_lora_rank + rope, kv_lora_rank)


def quantize_fp8_ds_mla(kv: torch.Tensor) -> torch.Tensor:
    """[N, 576] float -> [N, 656] uint8 in FlashMLA's V3.2 FP8 layout."""
    n = kv.shape[0]
    nope = kv[:, :512].float().view(n, 4, 128)
    scale = (nope.abs().amax(dim=-1) / 448.0).clamp_min(1e-8)  # [n, 4]
    fp8 = (nope / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(n, 512)
    out = torch.empty((n, 656), dtype=torch.uint8, device=kv.device)
    out[:, :512] = fp8.view(torch.uint8)
    out[:, 512:528] = scale.to(torch.float32).contiguous().view(torch.uint8).view(n, 16)
    out[:, 528:] = kv[:, 512:].to(torch.bfloat16).contiguous().view(torch.uint8).view(n, 128)
    return out


def dequantize_fp8_ds_mla(raw: torch.Tensor) -> torch.Tensor:
    """[N, 656] uint8 -> [N, 576] float32."""
    n = raw.shape[0]
    nope = raw[:, :512].contiguous().view(torch.float8_e4m3fn).float().view(n, 4, 128)
    scale = raw[:, 512:528].contiguous().view(torch.float32).view(n, 4, 1)
    rope = raw[:, 528:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(nope * scale).view(n, 512), rope], dim=1)


def sparse_decode_contract(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA sparse decode as documented: q [b, s, h, 576], kv [S, 576] float, indices
    [b, s, k] -> out [b, s, h, 512] bf16, natural-log lse [b, h, s]; a query with no valid
    index gets out 0 and lse +inf."""
    b, s, h, _ = q.shape
    idx = indices.reshape(b * s, -1).long()
    valid = idx >= 0
    gathered = kv[idx.clamp_min(0)]  # [bs, k, 576]
    scores = torch.einsum("thd,tkd->thk", q.reshape(b * s, h, -1).float(), gathered) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [bs, h]
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    out = torch.einsum("thk,tkd->thd", probs, gathered[..., :D_V])
    lonely = lse == float("-inf")
    out = out.masked_fill(lonely[..., None], 0.0)
    lse = lse.masked_fill(lonely, float("inf"))
    return out.to(torch.bfloat16).view(b, s, h, D_V), lse.view(b, s, h).transpose(1, 2)


def cpu_kernels(monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """Replace the compiled/Triton kernels of the sparse backend by CPU equivalents (through
    ``monkeypatch`` when given, undone after the test; for good in a spawned rank)."""
    set_attr = monkeypatch.setattr if monkeypatch is not None else setattr
    fs = compat.module("flashmla_sparse")

    def convert(req_id, block_table, token_indices, BLOCK_SIZE=64, NUM_TOPK_TOKENS=2048,
                return_valid_counts=False, BLOCK_STRIDE_ROWS=None, **_: Any):  # the DCP = 1 conversion, in torch
        tok = token_indices.long()
        block_id = tok.clamp_min(0) // BLOCK_SIZE
        valid = (tok >= 0) & (block_id < block_table.shape[1])
        base = block_table.long()[req_id.long()[:, None], block_id.clamp_max(block_table.shape[1] - 1)]
        out = torch.where(valid, base * (BLOCK_STRIDE_ROWS or BLOCK_SIZE) + tok % BLOCK_SIZE, -1).to(torch.int32)
        return (out, valid.sum(1, dtype=torch.int32)) if return_valid_counts else out

    def convert_for_group(self, topk, attn_metadata, *, block_stride_rows, return_valid_counts):
        # 0.33.0: decode-only DCP = 1 batches convert once per index group on a CUDA side stream
        return convert(attn_metadata.req_id_per_token[: topk.shape[0]], attn_metadata.block_table, topk,
                       BLOCK_SIZE=attn_metadata.block_size, BLOCK_STRIDE_ROWS=block_stride_rows,
                       return_valid_counts=return_valid_counts)

    def kernel(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
               indices=None, **_: Any):
        assert is_fp8_kvcache and indices is not None and head_dim_v == D_V
        if q.shape[-1] != D_QK or q.shape[2] not in (64, 128):  # the sparse fp8 decode kernel's h_q
            raise RuntimeError(f"FlashMLA sparse fp8 decode: q {tuple(q.shape)}, want [b, s, 64 or 128, {D_QK}]")
        kv = dequantize_fp8_ds_mla(k_cache.reshape(-1, 656))
        return sparse_decode_contract(q, kv, indices, softmax_scale)

    set_attr(fs, "triton_convert_req_index_to_global_index", convert)
    h.install_cpu_kernels(set_attr)  # the builders' own (token -> request mapping)
    if hasattr(fs.FlashMLASparseImpl, "_convert_logical_to_physical_topk"):
        set_attr(fs.FlashMLASparseImpl, "_convert_logical_to_physical_topk", convert_for_group)
    if hasattr(fs, "triton_filter_and_convert_dcp_index"):  # the DCP path's localization (patched 0.28.0, 0.29.0+)
        set_attr(fs, "triton_filter_and_convert_dcp_index", localize_standin)
    set_attr(fs, "flash_mla_with_kvcache", kernel)
    if hasattr(fs, "neutralize_dcp_empty_rows_"):  # 0.34.0's Triton kernel after the DCP decode
        set_attr(fs, "neutralize_dcp_empty_rows_", neutralize_dcp_empty_rows_standin)
    # The scheduler-metadata holder comes from the compiled extension's interface module.
    set_attr(fs, "get_mla_metadata", lambda *a, **k: (object(), None))


def neutralize_dcp_empty_rows_standin(out: torch.Tensor, lse: torch.Tensor, topk_indices: torch.Tensor) -> None:
    """``neutralize_dcp_empty_rows_`` (vLLM 0.34.0's Triton kernel) in torch: on rows where this DCP rank
    owns no top-k slot (every index -1), ``out`` 0 and ``lse`` -inf, the identity of the LSE merge."""
    num_tokens, num_heads, _ = out.shape
    assert lse.shape == (num_tokens, num_heads)
    assert topk_indices.ndim == 2 and topk_indices.shape[0] == num_tokens
    if num_tokens == 0:
        return
    empty = topk_indices.max(dim=1).values < 0
    lse[empty] = float("-inf")
    out[empty] = 0


def localize_standin(req_id, block_table, token_indices, dcp_size, dcp_rank, cp_kv_cache_interleave_size=1,
                     BLOCK_SIZE=64, BLOCK_STRIDE_ROWS=None, NUM_TOPK_TOKENS=2048, BLOCK_N=128,
                     return_valid_counts=False, compact_valid_to_front=True):
    """The documented contract of vLLM's Triton ``triton_filter_and_convert_dcp_index`` in torch:
    global positions -> this rank's slots (see :func:`py_localize`), -1 elsewhere; with
    ``compact_valid_to_front`` the valid slots first (order within them unspecified)."""
    tok = token_indices.long()
    il, n = cp_kv_cache_interleave_size, dcp_size
    local = (tok // (n * il)) * il + tok % il
    block = local // BLOCK_SIZE
    valid = (tok >= 0) & ((tok // il) % n == dcp_rank) & (block < block_table.shape[1])
    base = block_table.long()[req_id.long()[:, None], block.clamp(0, block_table.shape[1] - 1)]
    out = torch.where(valid, base * (BLOCK_STRIDE_ROWS or BLOCK_SIZE) + local % BLOCK_SIZE, -1)
    if compact_valid_to_front:
        out = torch.gather(out, 1, torch.argsort((~valid).int(), dim=1, stable=True))
    out = out.to(torch.int32)
    return (out, valid.sum(1, dtype=torch.int32)) if return_valid_counts else out


