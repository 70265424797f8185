"""The dense-MHA prefill's GPU kernels at their call boundary, for GLM-5's path harness on CPU ranks.

From vLLM 0.28.0 on, a GLM-5 prefill whose longest sequence is at most ``index_topk`` tokens skips the sparse
indexer and runs dense MHA (the release's metadata builder sets ``prefill.use_dense_mha``; the layer then
calls ``impl.forward_mha``, ``MLACommonBaseImpl.forward_mha``): the new tokens' attention by the prefill
backend (FlashAttention on Hopper), under DCP the cached context gathered from every rank's shard
(``cp_gather_and_upconvert_fp8_kv_cache``, then ``MLADCPManager.kv_gather``) and attended chunk by chunk, the
two merged by LSE (``merge_attn_states``). What is replaced, and by what:

- the prefill backend (:func:`flash_attn_prefill_standin`): where the release has a CPU MLA prefill backend
  (0.34.0's ``CPUSDPAMLAPrefillBackend``: the same ragged-batch contract, output ``[T, H, V]`` and LSE
  ``[H, T]`` in natural log, as FlashAttention returns them), that backend under FlashAttention's name;
  else (0.28.0) :func:`flash_attn_varlen_prefill_backend`, our own subclass of the release's
  ``MLAPrefillBackend`` computing FlashAttention's varlen contract in torch (:func:`flash_attn_varlen`:
  causal per request for the new tokens, unmasked for a context chunk, ``out=`` honoured, a row with no key
  LSE ``+inf`` as FlashAttention writes it);
- ``ops.cp_gather_and_upconvert_fp8_kv_cache``: :func:`cp_gather_and_upconvert_fp8_kv_cache`, the
  CUDA kernel's host checks (``csrc/cache_kernels.cu``) and then what it computes (each request's rows from
  ``seq_starts[b]`` through its block table, fp8_ds_mla -> bf16 ``[T, 576]``);
- the merge op: ``merge_attn_states`` dispatches as on CUDA (:class:`CudaDispatch`), to the release's own
  torch merge where its module has one (0.34.0's ``_merge_attn_states_torch``, its CPU fallback), else
  (0.28.0) to :func:`merge_attn_states_kernel`, the CUDA op's contract in torch (its host checks, its
  addressing by the prefix's head stride, an infinite LSE of either sign taken as ``-inf``);
- the direct (symmetric-memory) KV gather op: its host checks (:func:`direct_dcp_kv_gather_checks`), then an
  all-gather over the gloo group, as the kernel gathers. On CPU the manager picks it only when
  ``VLLM_USE_DIRECT_DCP_KV_GATHER`` says so (its default asks for CUDA): the steps gather with
  ``all_gather_into_tensor`` over gloo.

The context's ``reorg_kvcache``, ``kv_b_proj`` and the chunk bookkeeping around them are the release's own.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch

# The checks of ``cp_gather_and_upconvert_fp8_kv_cache`` (0.34.0's ``STD_TORCH_CHECK`` lines, in order;
# the device checks and the host-row checks left out: one device here, and GLM-5's cache has no host rows).
# 0.28.0's op makes the same checks but the last (its kernel reads 656 bytes a row all the same).
GATHER_CHECKS = (
    "block_table must be int32",
    "workspace_starts must be int32",
    "seq_starts must be int32",
    "src_cache must be uint8, float8_e4m3fn, or float8_e5m2",
    "dst must be bfloat16",
    "head_dim must be 576 for MLA",
    "src_cache rows must contain at least 656 bytes for MLA",
)


def cp_gather_and_upconvert_fp8_kv_cache(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                                         workspace_starts: torch.Tensor, batch_size: int,
                                         seq_starts: torch.Tensor | None = None, host_cache: Any = None,
                                         host_row_ids: Any = None, device_row_ids: Any = None) -> None:
    """Request ``b``'s rows ``dst[workspace_starts[b]:workspace_starts[b + 1]]`` (the last request's up to
    ``dst.shape[0]``) are its cache positions from ``seq_starts[b]`` on, dequantized."""
    import flashmla_standins as fk

    if block_table.dtype != torch.int32:
        raise RuntimeError(GATHER_CHECKS[0])
    if workspace_starts.dtype != torch.int32:
        raise RuntimeError(GATHER_CHECKS[1])
    if seq_starts is not None and seq_starts.dtype != torch.int32:
        raise RuntimeError(GATHER_CHECKS[2])
    if (host_cache is None) != (host_row_ids is None) or (host_cache is None) != (device_row_ids is None):
        raise RuntimeError("host_cache, host_row_ids, and device_row_ids must be provided together")
    if host_cache is not None:
        raise NotImplementedError("host-resident cache rows (HiSparse): not on GLM-5's default path")
    if src_cache.dtype not in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2):
        raise RuntimeError(f"{GATHER_CHECKS[3]}, but got {src_cache.dtype}")
    if dst.dtype != torch.bfloat16:
        raise RuntimeError(GATHER_CHECKS[4])
    if dst.shape[1] != 576:
        raise RuntimeError(GATHER_CHECKS[5])
    if src_cache.shape[2] * src_cache.element_size() < 656:
        raise RuntimeError(GATHER_CHECKS[6])
    block_size = src_cache.shape[1]
    total = dst.shape[0]
    starts = workspace_starts.tolist()
    for b in range(batch_size):
        begin = min(starts[b], total)
        end = min(starts[b + 1] if b + 1 < batch_size else total, total)
        source = int(seq_starts[b]) if seq_starts is not None else 0
        for i in range(max(end - begin, 0)):
            pos = source + i
            block = int(block_table[b, pos // block_size])
            row = src_cache[block, pos % block_size].view(torch.uint8).reshape(1, -1)[:, :656]
            dst[begin + i] = fk.dequantize_fp8_ds_mla(row)[0].to(torch.bfloat16)


# What FlashAttention (2 and 3) writes as the LSE of a query row with no key to attend (an empty key range,
# or a causal row above the diagonal): ``+inf``, the non-split kernels' ``(Split ? -INFINITY : INFINITY)``
# in ``softmax.h``'s ``finalize`` (the row's output is 0). ``merge_attn_states``'s CUDA kernel reads either
# infinity as ``-inf``.
EMPTY_ROW_LSE = float("inf")


def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                      causal: bool, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's varlen forward as vLLM's MLA prefill calls it (``flash_attn_varlen_func`` with
    ``return_softmax_lse=True``), in torch: request ``b``'s queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]``
    attend to its keys ``k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]`` (one K/V head per query head, as MLA's
    prefill expands them); ``causal`` masks bottom-right aligned (query ``i`` of ``Lq`` sees key ``j`` of ``Lk``
    iff ``j <= i + Lk - Lq``). Scores, softmax and the weighted sum in float32.

    Returns ``(out [Tq, H, Dv] in q's dtype, lse [H, Tq] float32, natural log)``; ``out``, when given, is
    written in place and returned (FlashAttention's ``out=``). Rows past ``cu_seqlens_q[-1]`` are left as
    they are; a row with no key gets output 0 and LSE :data:`EMPTY_ROW_LSE`."""
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"FlashAttention only supports fp16 and bf16 q/k/v of one dtype, got {q.dtype}, "
                           f"{k.dtype}, {v.dtype}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise RuntimeError("q, k and v must be [tokens, heads, head_dim]")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1] or k.shape[0] != v.shape[0]:
        raise RuntimeError(f"MLA prefill expands K/V to the query heads: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                           f"v {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise RuntimeError("q and k must have the same head dim")
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must be int32")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must hold one boundary per request and one more")
    tokens, heads, dim_v = q.shape[0], q.shape[1], v.shape[-1]
    if out is None:
        out = torch.empty(tokens, heads, dim_v, dtype=q.dtype)
    elif tuple(out.shape) != (tokens, heads, dim_v) or out.dtype != q.dtype:
        raise RuntimeError(f"out must be [{tokens}, {heads}, {dim_v}] {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    lse = torch.full((heads, tokens), EMPTY_ROW_LSE, dtype=torch.float32)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for (q0, q1), (k0, k1) in zip(pairwise(bounds_q), pairwise(bounds_k), strict=True):
        len_q, len_k = q1 - q0, k1 - k0
        if len_q > max_seqlen_q or len_k > max_seqlen_k:
            raise RuntimeError(f"a request of {len_q} queries and {len_k} keys is longer than max_seqlen_q "
                               f"{max_seqlen_q} / max_seqlen_k {max_seqlen_k}: the kernel would skip its tail")
        if len_q == 0:
            continue
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k[k0:k1].float()) * softmax_scale
        if causal:
            seen = (torch.arange(len_k)[None, :] <= torch.arange(len_q)[:, None] + (len_k - len_q))
            scores = scores.masked_fill(~seen, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [H, Lq]; -inf where the row sees no key
        empty = torch.isneginf(row_lse)
        probs = torch.exp(scores - row_lse.masked_fill(empty, 0.0)[..., None])
        out[q0:q1] = torch.einsum("hqk,khv->qhv", probs, v[k0:k1].float()).to(out.dtype)
        lse[:, q0:q1] = row_lse.masked_fill(empty, EMPTY_ROW_LSE)
    return out, lse


def flash_attn_varlen_prefill_backend() -> type:
    """FlashAttention's MLA prefill backend (``FLASH_ATTN``) as it runs on Hopper, a subclass of the release's
    own ``MLAPrefillBackend``: FA3 takes V unpadded (``v_head_dim`` output) and so honours ``out``; the new
    tokens attend causally per request (``prefill_metadata.query_start_loc``), a context chunk's queries
    (``chunk.query_start_loc``) to its gathered keys (``chunk.cu_seq_lens``) unmasked, both through
    :func:`flash_attn_varlen`. Its fused fp8 output is FA4's on Blackwell only: ``supports_quant_output``
    stays the base's False, and a caller passing ``output_scale`` anyway is refused."""
    from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend

    class FlashAttnVarlenPrefill(MLAPrefillBackend):
        requires_v_padding = False  # FA3 on SM90 takes a v_head_dim V

        @staticmethod
        def get_name() -> str:
            return "FLASH_ATTN"

        def supports_out(self) -> bool:  # a padded V's output could not be written into a v_head_dim `out`
            return not self.requires_v_padding

        def run_prefill_new_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   return_softmax_lse: bool, out: torch.Tensor | None = None,
                                   output_scale: torch.Tensor | None = None):
            if output_scale is not None:
                raise RuntimeError("FlashAttention on Hopper (FA3) writes no fp8 output: supports_quant_output "
                                   "is False, so no caller may pass output_scale")
            meta = self._prefill_metadata
            attn, lse = flash_attn_varlen(q, k, v, meta.query_start_loc, meta.query_start_loc, meta.max_query_len,
                                          meta.max_query_len, self.scale, causal=True, out=out)
            return (attn, lse) if return_softmax_lse else attn

        def run_prefill_context_chunk(self, chunk: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            return flash_attn_varlen(q, k, v, chunk.query_start_loc, chunk.cu_seq_lens, chunk.max_query_len,
                                     chunk.max_seq_len, self.scale, causal=False, out=out)

    return FlashAttnVarlenPrefill


def flash_attn_prefill_standin() -> type:
    """FlashAttention's MLA prefill backend (``FLASH_ATTN``, what Hopper selects): the release's own CPU
    prefill backend under FlashAttention's name where it has one (0.34.0), else
    :func:`flash_attn_varlen_prefill_backend` (0.28.0)."""
    try:
        from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
    except ImportError:
        return flash_attn_varlen_prefill_backend()

    class FlashAttnPrefillStandIn(CPUSDPAMLAPrefillBackend):
        @staticmethod
        def get_name() -> str:
            return "FLASH_ATTN"

        def supports_out(self) -> bool:  # FlashAttention writes `out` only when V needs no padding
            return self.v_head_dim >= self.qk_nope_head_dim + self.qk_rope_head_dim

    return FlashAttnPrefillStandIn


# The host checks of ``merge_attn_states`` (``csrc/.../attention/merge_attn_states.cu``, the same in 0.28.0 and
# 0.34.0), in the order the op makes them.
MERGE_CHECKS = (
    "output must be FP8 when output_scale is provided",
    "must match prefix_output dtype",
    "Unsupported data type of O",
    "headsize must be multiple of pack_size:",
    "prefix_num_tokens must be <= num_tokens",
)


def merge_attn_states_kernel(output: torch.Tensor, prefix_output: torch.Tensor, prefix_lse: torch.Tensor,
                             suffix_output: torch.Tensor, suffix_lse: torch.Tensor,
                             output_lse: torch.Tensor | None = None, prefill_tokens_with_context: int | None = None,
                             output_scale: torch.Tensor | None = None) -> None:
    """``vllm._custom_ops.merge_attn_states`` (the CUDA kernel) in torch, for a release whose merge module has
    no torch merge of its own. ``output``/``prefix_output``/``suffix_output`` ``[T, H, D]``, LSEs ``[H, T]``
    float32 read by their strides. As the kernel does:

    - it reads ``prefix_output`` and ``suffix_output`` both at ``prefix_output``'s head stride, token ``t``
      head ``h`` at ``(t * H + h) * head_stride`` (and writes ``output`` at its own head stride);
    - tokens from ``prefill_tokens_with_context`` on (default: none) copy the suffix and its raw LSE;
    - an infinite LSE of either sign counts as ``-inf``; both ``-inf``: the prefix is copied, LSE ``-inf``;
    - else ``p = exp(lse_p - m)``, ``s = exp(lse_s - m)`` (``m`` the larger, NaN ignored as ``fmaxf`` does),
      output ``(o_p * p + o_s * s) / (p + s)`` in float32, LSE ``log(p + s) + m``;
    - with ``output_scale`` the output is fp8, each value times ``1 / scale`` saturated to the fp8 range."""
    if output_scale is not None:
        if output.dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            raise RuntimeError(f"{MERGE_CHECKS[0]}, got: {output.dtype}")
    elif output.dtype != prefix_output.dtype:
        raise RuntimeError(f"output dtype ({output.dtype}) {MERGE_CHECKS[1]} ({prefix_output.dtype}) when "
                           "output_scale is not set")
    if prefix_output.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise RuntimeError(f"{MERGE_CHECKS[2]}: {prefix_output.dtype}")
    tokens, heads, head_size = output.shape
    pack = 16 // prefix_output.element_size()
    if head_size % pack:
        raise RuntimeError(f"{MERGE_CHECKS[3]}{pack}")
    merged = tokens if prefill_tokens_with_context is None else int(prefill_tokens_with_context)
    if not 0 <= merged <= tokens:  # the kernel takes the count as unsigned: a negative one is past every token
        raise RuntimeError(MERGE_CHECKS[4])

    def laid_out(t: torch.Tensor, head_stride: int) -> torch.Tensor:
        return t.as_strided((tokens, heads, head_size), (heads * head_stride, head_stride, 1))

    prefix = laid_out(prefix_output, prefix_output.stride(1)).float()
    suffix = laid_out(suffix_output, prefix_output.stride(1)).float()
    dst = laid_out(output, output.stride(1))
    p_lse, s_lse = prefix_lse[:, :tokens].float(), suffix_lse[:, :tokens].float()
    p_lse = p_lse.masked_fill(torch.isinf(p_lse), float("-inf"))
    s_lse = s_lse.masked_fill(torch.isinf(s_lse), float("-inf"))
    top = torch.fmax(p_lse, s_lse)
    empty = torch.isinf(top)
    p_se = torch.exp(p_lse - top.masked_fill(empty, 0.0))
    s_se = torch.exp(s_lse - top.masked_fill(empty, 0.0))
    total = p_se + s_se
    weights = (p_se / total).T[..., None], (s_se / total).T[..., None]  # [T, H, 1]
    values = prefix * weights[0] + suffix * weights[1]
    values = torch.where(empty.T[..., None], prefix, values)
    lse = torch.where(empty, top, torch.log(total) + top)
    with_context = torch.arange(tokens)[:, None, None] < merged
    values = torch.where(with_context, values, suffix)
    lse = torch.where(with_context[:, :, 0].T, lse, suffix_lse[:, :tokens].float())
    if output_scale is not None:
        limit = torch.finfo(output.dtype).max
        values = (values * (1.0 / float(output_scale))).clamp(-limit, limit)
    dst.copy_(values.to(output.dtype))
    if output_lse is not None:
        output_lse[:, :tokens] = lse


class CudaDispatch:
    """``current_platform`` as ``merge_attn_states``'s dispatcher asks it: CUDA (so it takes the compiled
    op's branch, whose stand-in is installed); everything else is the real platform's."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def is_cuda(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)


def direct_dcp_kv_gather_checks(local_kv: torch.Tensor, received_kv: torch.Tensor, received_signal: torch.Tensor,
                                completion: torch.Tensor, epoch: torch.Tensor, gathered_kv: torch.Tensor,
                                world_size: int, rank: int, max_gathered_tokens: int, kv_mc_ptr: int,
                                signal_mc_ptr: int) -> None:
    """The host checks of ``torch.ops._C.direct_dcp_kv_gather`` (``dcp_direct_kv_gather.cu``, the same in 0.28.0
    and 0.34.0), in order, but the CUDA-device ones (one CPU device here)."""
    if local_kv.dtype not in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        raise RuntimeError("direct DCP kv-gather only supports FP16, BF16, and FP8")
    if local_kv.dim() != 2 or not local_kv.is_contiguous():
        raise RuntimeError("local kv must be a contiguous [T,D] tensor")
    if world_size <= 1:
        raise RuntimeError("world_size must be greater than 1")
    if not 0 <= rank < world_size:
        raise RuntimeError("invalid rank")
    tokens, dim = local_kv.shape
    if tokens <= 0 or dim <= 0:
        raise RuntimeError("local kv dimensions must be positive")
    if tokens * world_size > max_gathered_tokens:
        raise RuntimeError("gathered kv exceeds symmetric kv-gather buffer capacity")
    if (received_kv.dtype != local_kv.dtype or not received_kv.is_contiguous()
            or tuple(received_kv.shape) != (2, max_gathered_tokens, dim)):
        raise RuntimeError("received kv has the wrong symmetric buffer layout")
    if (not received_signal.is_contiguous() or received_signal.dtype != torch.int32
            or tuple(received_signal.shape) != (2, world_size)):
        raise RuntimeError("received signal has the wrong symmetric buffer layout")
    if not completion.is_contiguous() or completion.dtype != torch.int32 or completion.numel() != 2:
        raise RuntimeError("completion counter must be a two-element CUDA int32 tensor")
    if not epoch.is_contiguous() or epoch.dtype != torch.int64 or epoch.numel() != 1:
        raise RuntimeError("epoch must be a one-element CUDA int64 tensor")
    if (gathered_kv.dtype != local_kv.dtype or not gathered_kv.is_contiguous()
            or tuple(gathered_kv.shape) != (tokens * world_size, dim)):
        raise RuntimeError("gathered kv must be contiguous with shape [world_size*T,D]")
    size = local_kv.element_size()
    if (any(t.data_ptr() % 16 for t in (local_kv, received_kv, gathered_kv)) or tokens * dim * size % 16
            or max_gathered_tokens * dim * size % 16):
        raise RuntimeError("direct DCP kv-gather requires 16-byte-aligned pointers and strides")
    if not kv_mc_ptr or not signal_mc_ptr:
        raise RuntimeError("direct DCP kv-gather requires multicast pointers")


def install(rank_group: Any | None) -> None:
    """The stand-ins above, for good in this rank (``rank_group``: the DCP group, None at DCP 1). The merge
    module's dispatcher takes the compiled op's branch (:class:`CudaDispatch`), where the release's own torch
    merge stands in for the op (0.34.0's ``_merge_attn_states_torch``), else :func:`merge_attn_states_kernel`."""
    import importlib

    import torch.distributed as dist
    from vllm import _custom_ops as ops

    ops.cp_gather_and_upconvert_fp8_kv_cache = cp_gather_and_upconvert_fp8_kv_cache
    mas = importlib.import_module("vllm.v1.attention.ops.merge_attn_states")
    ops.merge_attn_states = getattr(mas, "_merge_attn_states_torch", merge_attn_states_kernel)
    mas.current_platform = CudaDispatch(mas.current_platform)
    if rank_group is None:
        return

    def direct_dcp_kv_gather(*args: Any) -> None:
        direct_dcp_kv_gather_checks(*args)
        local_kv, gathered_kv = args[0], args[5]
        dist.all_gather_into_tensor(gathered_kv, local_kv, group=rank_group.device_group)

    torch.ops._C.direct_dcp_kv_gather = direct_dcp_kv_gather
