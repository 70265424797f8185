"""Test-only plain-PyTorch stand-in for DeepGEMM's MQA-logits kernels (the DSA indexer's scores).

What it is: a ``deep_gemm`` package that vLLM 0.28.0's wrapper ``vllm.utils.deep_gemm`` picks up
(``_import_deep_gemm`` imports a top-level ``deep_gemm`` before the vendored
``vllm.third_party.deep_gemm``) when ``tests/engine/standin`` is first on ``PYTHONPATH``. It lets
the engine run a GLM-5-architecture (DeepSeek-V3.2-style sparse MLA) model on a GPU machine whose
torch cannot load the vendored DeepGEMM extension. It is put on ``PYTHONPATH`` for device test runs
only; it never goes into a wheel or an image.

What it implements (the FP8 path of the bf16 sparse indexer, nothing else):

* ``fp8_fp4_mqa_logits((q, None), (k, k_scale), weights, cu_seqlen_ks, cu_seqlen_ke,
  clean_logits)``: prefill logits. ``q`` float8_e4m3fn ``[M, H, D]``, ``k`` float8_e4m3fn
  ``[N, D]``, ``k_scale`` float32 ``[N]`` (or ``[N, 1]``), ``weights`` float32 ``[M, H]``.
  Returns float32 ``[M, N]`` with
  ``logits[m, n] = sum_h relu((q[m, h] . k[n]) * k_scale[n]) * weights[m, h]`` for
  ``cu_seqlen_ks[m] <= n < cu_seqlen_ke[m]`` and ``-inf`` elsewhere. That is the form vLLM 0.28.0
  calls. vLLM 0.33.0 (DeepGEMM >= 2.8) passes ``max_seqlen_k`` (an int) as the sixth argument
  instead and reads *compressed* logits ``[M, max_seqlen_k]``: row ``m``, column ``j`` holds key
  ``cu_seqlen_ks[m] + j`` (its ``sparse_attn_indexer`` gives the top-k ``cu_seqlen_ke - cu_seqlen_ks``
  as each row's length and no start); here columns past a row's length are ``-inf``.
* ``fp8_fp4_paged_mqa_logits((q, None), kv_cache, weights, context_lens, block_tables,
  schedule_metadata, max_model_len, clean_logits, indices=None)``: decode logits over the paged
  indexer K cache. ``q`` float8_e4m3fn ``[B, next_n, H, D]``, ``weights`` float32
  ``[B * next_n, H]``. Row ``b * next_n + j`` of the float32 ``[B * next_n, max_model_len]``
  result holds the logits (same formula) of positions ``t < len[b, j]``, ``-inf`` elsewhere.
  Token ``t`` of request ``b`` lives in block ``block_tables[b, t // block_size]`` at offset
  ``t % block_size``. ``context_lens`` ``[B, next_n]`` gives ``len`` directly; a 1-D
  ``context_lens[B]`` means DeepGEMM's causal MTP form ``len[b, j] = context_lens[b] - next_n
  + 1 + j``. ``schedule_metadata`` is accepted and ignored.
* ``get_paged_mqa_logits_metadata(context_lens, block_size, num_sms)``: an int32 zero tensor
  ``[num_sms + 1, 2]`` on ``context_lens``' device (only this module's paged function consumes it,
  and that ignores it).
* ``get_num_sms`` / ``set_num_sms``: the device's SM count, or the value set (0 resets).

Paged K-cache layout (``kv_cache`` uint8 ``[num_blocks, block_size, 1, D + 4]``, block stride
``kv_cache.stride(0)``): per block, first the ``block_size * D`` fp8 values of all its tokens
(token ``o`` at byte ``o * D``), then ``block_size`` float32 scales (token ``o`` at byte
``block_size * D + 4 * o``); not interleaved per token. Evidence: vLLM's CUDA writer
``_fp8_quant_and_cache_write`` in ``vllm/models/deepseek_v32/common/kernels.py`` stores the value
at ``block_start + block_offset * HEAD_DIM`` and the scale at ``block_start + cache_block_size *
HEAD_DIM + block_offset * 4`` (lines 76-86), and ``cp_gather_indexer_k_quant_cache_triton`` in
``vllm/v1/attention/ops/rocm_aiter_mla_sparse.py`` splits a block as ``[:, : block_size *
head_dim]`` values / ``[:, block_size * head_dim :]`` scales.

Not provided on purpose: every GEMM entry point (``fp8_gemm_nt``, ``m_grouped_*``,
``fp8_einsum``, ``tf32_hc_prenorm_gemm``, layout/scale helpers, ``set_pdl``). vLLM resolves them
with ``getattr(..., None)``, so its linear and MoE layers keep their own kernels, ``_fp8_gemm_nt_impl``
stays ``None`` and DeepGEMM E8M0 scaling stays off (``DeepGemmQuantScaleFMT`` resolves to
``FLOAT32``). The FP4 (MXFP4) cache path and the SM100 ``indices`` varlen decode raise
``NotImplementedError``.

What differs from production: only the indexer's two logits kernels are replaced. The math is
plain torch in fp32 (fp8 inputs are widened to float32; the dot products run on raw fp8 values,
which are exact in TF32 too, and the scale, ReLU, head weights and head sum follow in fp32), so
results match DeepGEMM up to fp32 summation order, deterministically, only slower.
``clean_logits`` is ignored: positions outside the valid range are always ``-inf``, so stale
values can never be picked. vLLM 0.34.0 passes ``logits_dtype`` (keyword) to both logits kernels:
``torch.float32`` (its default, and what it resolves off SM100) or ``torch.bfloat16`` (SM100's
default); the stand-in computes in float32 and returns that dtype, and refuses any other dtype
(0.34.0's wrapper documents only those two). Top-k selection, the K-cache writer and gather, FlashMLA-sparse
attention and the DCP paths remain vLLM's real kernels.

Constraints kept: peak extra memory is bounded (rows / requests are processed in chunks of about
``_ELEMENT_BUDGET`` float32 temporaries; ``[H, M, N]`` is never materialised), and the paged
function is CUDA-graph capturable: no host syncs, no data-dependent shapes, Python branches only on
shapes.
"""

from __future__ import annotations

import torch

__all__ = [
    "fp8_fp4_mqa_logits",
    "fp8_fp4_paged_mqa_logits",
    "get_num_sms",
    "get_paged_mqa_logits_metadata",
    "set_num_sms",
]

# Max float32 elements of the big per-chunk temporary (scores of a row/request chunk): 64 MiB.
_ELEMENT_BUDGET = 1 << 24

_num_sms: int | None = None


def get_num_sms() -> int:
    """SM count kernels may use: the value given to ``set_num_sms``, else the device's."""
    if _num_sms is not None:
        return _num_sms
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 1


def set_num_sms(num_sms: int) -> None:
    """Record an SM cap (0 resets to the device's count); the torch math ignores it."""
    global _num_sms
    if num_sms < 0:
        raise ValueError(f"num_sms must be >= 0, got {num_sms}")
    _num_sms = int(num_sms) if num_sms > 0 else None


def _fp8_values(q: tuple[torch.Tensor, torch.Tensor | None] | torch.Tensor) -> torch.Tensor:
    """The FP8 Q values of a ``(values, scales_or_None)`` pair; FP4 Q is not supported."""
    if isinstance(q, tuple):
        values, scales = q
        if scales is not None:
            raise NotImplementedError("deep_gemm stand-in: the MXFP4 (FP4) Q/K path is not implemented")
    else:
        values = q
    if values.dtype != torch.float8_e4m3fn:
        raise TypeError(f"deep_gemm stand-in: Q must be float8_e4m3fn, got {values.dtype}")
    return values


_LOGITS_DTYPES = (torch.float32, torch.bfloat16)


def _check_logits_dtype(logits_dtype: torch.dtype) -> None:
    if logits_dtype not in _LOGITS_DTYPES:
        raise TypeError(f"deep_gemm stand-in: logits_dtype must be float32 or bfloat16, got {logits_dtype}")


def fp8_fp4_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None] | torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool | int = True,
    *,
    max_seqlen_k: int | None = None,
    logits_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Non-paged (prefill) MQA logits ``[M, N]`` float32, ``-inf`` outside ``[ks[m], ke[m])``; with
    ``max_seqlen_k`` (an int sixth argument, vLLM 0.33.0's form) compressed ``[M, max_seqlen_k]``:
    column ``j`` of row ``m`` is key ``ks[m] + j``, ``-inf`` from ``ke[m] - ks[m]`` on. ``logits_dtype``
    (vLLM 0.34.0's keyword) is the dtype returned."""
    _check_logits_dtype(logits_dtype)
    if max_seqlen_k is None and not isinstance(clean_logits, bool):
        max_seqlen_k = int(clean_logits)  # the sixth positional argument of DeepGEMM >= 2.8
    # the full form is always clean: out-of-range positions are -inf
    q_values = _fp8_values(q)
    k_values, k_scale = kv
    if k_values.dtype != torch.float8_e4m3fn or k_values.dim() != 2:
        raise TypeError(
            f"deep_gemm stand-in: K must be float8_e4m3fn [N, D], got {k_values.dtype} {tuple(k_values.shape)}"
        )
    if q_values.dim() != 3 or q_values.shape[2] != k_values.shape[1]:
        raise ValueError(
            f"deep_gemm stand-in: Q must be [M, H, D] with D = {k_values.shape[1]}, got {tuple(q_values.shape)}"
        )
    num_q, num_heads, head_dim = q_values.shape
    num_k = k_values.shape[0]
    if k_scale.numel() != num_k:
        raise ValueError(f"deep_gemm stand-in: K scales must have {num_k} entries, got {tuple(k_scale.shape)}")
    if tuple(weights.shape) != (num_q, num_heads):
        raise ValueError(f"deep_gemm stand-in: weights must be [{num_q}, {num_heads}], got {tuple(weights.shape)}")
    device = q_values.device

    k_t = k_values.float().t()  # [D, N]
    scale = k_scale.reshape(num_k).float()
    cols = torch.arange(num_k, device=device)
    ks = cu_seqlen_ks.reshape(num_q, 1)
    ke = cu_seqlen_ke.reshape(num_q, 1)
    width = num_k if max_seqlen_k is None else max(0, int(max_seqlen_k))
    out = torch.empty((num_q, width), dtype=torch.float32, device=device)
    offsets = torch.arange(width, device=device)
    rows = max(1, _ELEMENT_BUDGET // max(1, num_heads * num_k))
    for start in range(0, num_q, rows):
        end = min(num_q, start + rows)
        n_rows = end - start
        scores = torch.matmul(q_values[start:end].float().reshape(n_rows * num_heads, head_dim), k_t)
        scores.mul_(scale).relu_()
        scores = scores.view(n_rows, num_heads, num_k)
        scores.mul_(weights[start:end].float().unsqueeze(-1))
        logits = scores.sum(dim=1)
        if max_seqlen_k is None:
            valid = (cols >= ks[start:end]) & (cols < ke[start:end])
            out[start:end] = torch.where(valid, logits, float("-inf"))
            continue
        keys = ks[start:end].to(torch.int64) + offsets  # [rows, width]: the key of each column
        valid = (offsets < (ke[start:end] - ks[start:end])) & (keys < num_k)
        picked = logits.gather(1, keys.clamp(0, max(0, num_k - 1))) if num_k else logits.new_zeros(keys.shape)
        out[start:end] = torch.where(valid, picked, float("-inf"))
    return out if logits_dtype == torch.float32 else out.to(logits_dtype)


def get_paged_mqa_logits_metadata(
    context_lens: torch.Tensor,
    block_size: int,
    num_sms: int,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scheduling metadata stand-in: int32 zeros ``[num_sms + 1, 2]`` (ignored by the paged logits)."""
    del block_size
    if indices is not None:
        raise NotImplementedError("deep_gemm stand-in: varlen paged MQA logits (indices=...) are not implemented")
    return torch.zeros((num_sms + 1, 2), dtype=torch.int32, device=context_lens.device)


def _kv_pages(kv_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[num_blocks, block_size * (D + 4)]`` uint8 view of each block's bytes (page stride kept)."""
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        raise TypeError(
            "deep_gemm stand-in: kv_cache must be uint8 [num_blocks, block_size, 1, D + 4], "
            f"got {kv_cache.dtype} {tuple(kv_cache.shape)}"
        )
    num_blocks, block_size, _, width = kv_cache.shape
    if width != head_dim + 4:
        raise ValueError(f"deep_gemm stand-in: kv_cache last dim must be D + 4 = {head_dim + 4}, got {width}")
    if kv_cache.stride(3) != 1 or (block_size > 1 and kv_cache.stride(1) != width):
        raise ValueError(f"deep_gemm stand-in: each kv_cache block must be contiguous, strides {kv_cache.stride()}")
    return torch.as_strided(kv_cache, (num_blocks, block_size * width), (kv_cache.stride(0), 1))


def fp8_fp4_paged_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None] | torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    schedule_metadata: torch.Tensor,
    max_model_len: int,
    clean_logits: bool = True,
    indices: torch.Tensor | None = None,
    *,
    logits_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Paged (decode) MQA logits ``[B * next_n, max_model_len]`` in ``logits_dtype`` (float32 unless
    vLLM 0.34.0 asks for bfloat16); graph-capturable."""
    _check_logits_dtype(logits_dtype)
    del schedule_metadata, clean_logits  # metadata unused; out-of-range positions are always -inf
    if indices is not None:
        raise NotImplementedError("deep_gemm stand-in: varlen paged MQA logits (indices=...) are not implemented")
    q_values = _fp8_values(q)
    if q_values.dim() != 4:
        raise ValueError(f"deep_gemm stand-in: Q must be [B, next_n, H, D], got {tuple(q_values.shape)}")
    batch, next_n, num_heads, head_dim = q_values.shape
    pages = _kv_pages(kv_cache, head_dim)
    num_blocks, block_size = kv_cache.shape[:2]
    if tuple(weights.shape) != (batch * next_n, num_heads):
        raise ValueError(
            f"deep_gemm stand-in: weights must be [{batch * next_n}, {num_heads}], got {tuple(weights.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"deep_gemm stand-in: block_tables must be [{batch}, max_blocks], got {block_tables.shape}")
    device = q_values.device

    # Effective context length of every Q row, [B, next_n].
    if context_lens.dim() == 1:
        if context_lens.shape[0] != batch:
            raise ValueError(f"deep_gemm stand-in: context_lens must be [{batch}], got {tuple(context_lens.shape)}")
        offsets = torch.arange(next_n, device=device, dtype=torch.int64)
        lens = context_lens.to(torch.int64).unsqueeze(1) - (next_n - 1) + offsets
    elif tuple(context_lens.shape) == (batch, next_n):
        lens = context_lens.to(torch.int64)
    else:
        raise ValueError(
            f"deep_gemm stand-in: context_lens must be [{batch}] or [{batch}, {next_n}], "
            f"got {tuple(context_lens.shape)}"
        )

    out = torch.full((batch * next_n, max_model_len), float("-inf"), dtype=logits_dtype, device=device)
    num_table_blocks = min(block_tables.shape[1], -(-max_model_len // block_size))
    span = num_table_blocks * block_size  # positions covered by the block table
    width = min(span, max_model_len)
    if batch == 0 or width == 0:
        return out

    positions = torch.arange(span, device=device)
    value_bytes = block_size * head_dim
    per_request = span * (next_n * num_heads + head_dim + (head_dim + 4) // 4 + 1)
    group = max(1, _ELEMENT_BUDGET // per_request)
    for b0 in range(0, batch, group):
        b1 = min(batch, b0 + group)
        n_req = b1 - b0
        block_ids = block_tables[b0:b1, :num_table_blocks].to(torch.int64).clamp(0, num_blocks - 1)
        raw = pages[block_ids]  # [G, blocks, block_size * (D + 4)] uint8
        k = raw[..., :value_bytes].view(torch.float8_e4m3fn).float().reshape(n_req, span, head_dim)
        k_scale = raw[..., value_bytes:].contiguous().view(torch.float32).reshape(n_req, 1, span)
        q_group = q_values[b0:b1].float().reshape(n_req, next_n * num_heads, head_dim)
        scores = torch.bmm(q_group, k.transpose(1, 2))  # [G, next_n * H, span]
        scores.mul_(k_scale).relu_()
        scores = scores.view(n_req, next_n, num_heads, span)
        scores.mul_(weights[b0 * next_n : b1 * next_n].float().view(n_req, next_n, num_heads, 1))
        logits = scores.sum(dim=2)  # [G, next_n, span]
        valid = positions < lens[b0:b1].unsqueeze(-1)
        logits = torch.where(valid, logits, float("-inf"))
        out[b0 * next_n : b1 * next_n, :width] = logits.reshape(n_req * next_n, span)[:, :width]
    return out
