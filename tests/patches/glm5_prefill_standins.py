"""The dense-MHA prefill's GPU kernels at their call boundary, for GLM-5's path harness on CPU ranks.

Since vLLM 0.29.0 a GLM-5 prefill whose longest sequence is at most ``index_topk`` tokens skips the
sparse indexer and runs dense MHA (``MLAAttention.forward_impl`` -> ``forward_mha``): the new tokens'
attention by the prefill backend (FlashAttention on Hopper), under DCP the cached context gathered from
every rank's shard (``cp_gather_and_upconvert_fp8_kv_cache``, then ``MLADCPManager.kv_gather``) and
attended chunk by chunk, the two merged by LSE (``merge_attn_states``). What is replaced, and by what:

- the prefill backend: :func:`flash_attn_prefill_standin`, the release's own CPU MLA prefill backend
  (``CPUSDPAMLAPrefillBackend``: the same ragged-batch contract, output ``[T, H, V]`` and LSE
  ``[H, T]`` in natural log, as FlashAttention returns them) under FlashAttention's name;
- ``ops.cp_gather_and_upconvert_fp8_kv_cache``: :func:`cp_gather_and_upconvert_fp8_kv_cache`, the
  CUDA kernel's host checks (``csrc/cache_kernels.cu``, 0.34.0) and then what it computes (each
  request's rows from ``seq_starts[b]`` through its block table, fp8_ds_mla -> bf16 ``[T, 576]``);
- the merge op: ``merge_attn_states`` dispatches as on CUDA, to :func:`merge_attn_states_op`, the
  release's own torch merge (its CPU fallback, the same arithmetic as the CUDA kernel);
- the direct (symmetric-memory) KV gather op: an all-gather over the gloo group, as the kernel gathers.
"""

from __future__ import annotations

from typing import Any

import torch

# The checks of ``cp_gather_and_upconvert_fp8_kv_cache`` (0.34.0's ``STD_TORCH_CHECK`` lines, in order;
# the device checks and the host-row checks left out: one device here, and GLM-5's cache has no host rows).
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


class PrefillRefused:
    """The dense-MHA prefill backend of a release without a CPU prefill backend of its own (0.28.0): built,
    cloned and given metadata as vLLM does; running it is a harness error (no case of such a release's
    harness takes the dense prefill)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def clone(self) -> PrefillRefused:  # each metadata builder takes its own copy
        return self

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        pass

    def supports_quant_output(self, quant_key: Any) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        import compat

        raise compat.HarnessError(f"the dense-MHA prefill backend was used ({name}) on a release without a CPU "
                                  "prefill backend to stand in for it")


def flash_attn_prefill_standin() -> type:
    """FlashAttention's MLA prefill backend (``FLASH_ATTN``, what Hopper selects) computed by the release's
    own CPU prefill backend (:class:`PrefillRefused` where the release has none)."""
    try:
        from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
    except ImportError:
        return PrefillRefused

    class FlashAttnPrefillStandIn(CPUSDPAMLAPrefillBackend):
        @staticmethod
        def get_name() -> str:
            return "FLASH_ATTN"

        def supports_out(self) -> bool:  # FlashAttention writes `out` only when V needs no padding
            return self.v_head_dim >= self.qk_nope_head_dim + self.qk_rope_head_dim

    return FlashAttnPrefillStandIn


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


def install(rank_group: Any | None) -> None:
    """The stand-ins above, for good in this rank (``rank_group``: the DCP group, None at DCP 1)."""
    import importlib

    import torch.distributed as dist
    from vllm import _custom_ops as ops

    ops.cp_gather_and_upconvert_fp8_kv_cache = cp_gather_and_upconvert_fp8_kv_cache
    mas = importlib.import_module("vllm.v1.attention.ops.merge_attn_states")
    if hasattr(mas, "_merge_attn_states_torch"):  # the compiled op's arithmetic, the release's own torch
        ops.merge_attn_states = mas._merge_attn_states_torch
        mas.current_platform = CudaDispatch(mas.current_platform)
    if rank_group is None:
        return

    def direct_dcp_kv_gather(local_kv, received_kv, received_signal, completion, epoch, gathered_kv, world_size,
                             rank, max_gathered_tokens, kv_mc_ptr, signal_mc_ptr):
        if local_kv.shape[0] * world_size > max_gathered_tokens:
            raise RuntimeError("direct DCP kv-gather: tokens exceed the symmetric buffer capacity")
        dist.all_gather_into_tensor(gathered_kv, local_kv.contiguous(), group=rank_group.device_group)

    torch.ops._C.direct_dcp_kv_gather = direct_dcp_kv_gather
