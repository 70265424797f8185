"""The compiled DCP ops' host-side argument checks, per release, and a stand-in that keeps them.

A stand-in for a compiled op is only as good as what it refuses: one that accepts what the real op
refuses hides a crash (vLLM 0.33.0's direct A2A kernel refuses a combine whose workspace output is
sized for ``v_head_dim`` while the partials carry ``kv_lora_rank``), and one that refuses what the
real op accepts fails a test for a bug production does not have. The checks here are the
``STD_TORCH_CHECK`` lines of each release's ``csrc/.../dcp_direct_a2a_lse_reduce.cu``
(``direct_dcp_a2a_lse_reduce``), in their order and with their messages; :data:`A2A_CHECKS` says
which release has which (0.28.0 also requires packed LSE heads; 0.29.0 reads an LSE head stride).
Left out, and said so: the CUDA-device checks (the CPU runs have none) and the staging/peer-pointer
dtype checks, whose tensors come from the symmetric-memory stand-in, not from the code under test.

:func:`direct_a2a_lse_reduce` is the op for a gloo DCP group: the checks, then what the kernel
computes (each rank sends every destination its heads' partials and LSE over ``all_to_all``; a row
whose sequence, found as the kernel finds it from ``query_start_loc``, has no local KV is sent with
zero weight; the destination merges by LSE).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from packaging.version import Version

# check name -> (first release with it, last release with it or None)
A2A_CHECKS: dict[str, tuple[str, str | None]] = {
    "output_dtype": ("0.28.0", None),
    "lse_dtype": ("0.28.0", None),
    "ranks": ("0.28.0", None),
    "world": ("0.28.0", None),
    "packed_output": ("0.28.0", None),
    "packed_lse": ("0.28.0", "0.28.0"),  # 0.29.0 passes the LSE head stride to the kernel instead
    "capacity": ("0.28.0", None),
    "heads_divide": ("0.28.0", None),
    "lse_shape": ("0.28.0", None),
    "head_dim_8": ("0.28.0", None),
    "combined_contiguous": ("0.28.0", None),
    "combined_shape": ("0.28.0", None),
    "bounds_together": ("0.28.0", None),
    "bounds_int32": ("0.28.0", None),
    "one_boundary_per_sequence": ("0.28.0", None),
}


def has_check(name: str, version: Version) -> bool:
    first, last = A2A_CHECKS[name]
    return Version(first) <= version and (last is None or version <= Version(last))


class KernelRefusal(RuntimeError):
    """What the compiled op raises (``STD_TORCH_CHECK``): the message is the kernel's own."""


def check_a2a_arguments(version: Version, partial_output: Any, partial_lse: Any, seq_lens: Any,
                        query_start_loc: Any, combined_output: Any, world_size: int, rank: int,
                        max_num_tokens: int) -> None:
    """``direct_dcp_a2a_lse_reduce``'s host checks of release ``version``, in the kernel's order."""
    import torch

    def need(name: str, ok: bool, message: str) -> None:
        if has_check(name, version) and not ok:
            raise KernelRefusal(message)

    half = (torch.float16, torch.bfloat16)
    need("output_dtype", partial_output.dtype in half, "direct DCP A2A only supports FP16 and BF16 output")
    need("lse_dtype", partial_lse.dtype in (torch.float32, *half), "partial LSE must be FP32, FP16, or BF16")
    need("ranks", partial_output.dim() == 3 and partial_lse.dim() == 2, "expected output [T,H,D] and LSE [T,H]")
    need("world", world_size > 1, "world_size must be greater than 1")
    need("world", 0 <= rank < world_size, "invalid rank")
    num_tokens, total_heads, head_dim = partial_output.shape
    need("packed_output", partial_output.stride(2) == 1 and partial_output.stride(1) == head_dim
         and partial_output.stride(0) >= total_heads * head_dim and partial_output.stride(0) % 8 == 0,
         "partial output must have packed heads and an aligned token stride")
    need("packed_lse", partial_lse.stride(1) == 1 and partial_lse.stride(0) >= total_heads,
         "partial LSE must have packed heads")
    need("capacity", 0 < num_tokens <= max_num_tokens, "token count exceeds symmetric buffer capacity")
    need("heads_divide", total_heads % world_size == 0, "attention heads must divide evenly across DCP ranks")
    need("lse_shape", tuple(partial_lse.shape) == (num_tokens, total_heads), "LSE shape must match attention output")
    need("head_dim_8", head_dim % 8 == 0, "head_dim must be divisible by 8 for 16-byte stores")
    need("combined_contiguous", combined_output.dtype == partial_output.dtype and combined_output.is_contiguous(),
         "combined output must match the contiguous CUDA input")
    need("combined_shape", tuple(combined_output.shape) == (num_tokens, total_heads // world_size, head_dim),
         "combined output has the wrong shape")
    need("bounds_together", (seq_lens is None) == (query_start_loc is None),
         "seq_lens and query_start_loc must be provided together")
    if seq_lens is not None:
        for t, what in ((seq_lens, "seq_lens"), (query_start_loc, "query_start_loc")):
            need("bounds_int32", t.dim() == 1 and t.stride(0) == 1 and t.dtype == torch.int32,
                 f"{what} must be a contiguous 1-D int32 CUDA tensor")
        need("one_boundary_per_sequence", seq_lens.numel() > 0 and query_start_loc.numel() == seq_lens.numel() + 1,
             "query_start_loc must contain one boundary per sequence")


def empty_kv_rows(num_tokens: int, seq_lens: Any, query_start_loc: Any) -> Any:
    """The rows the kernel sends with zero weight: those whose sequence (the kernel's binary search of
    ``query_start_loc``: the last boundary at or before the row) has no KV on this rank. Rows past the
    last boundary belong to the last sequence, as in the kernel; nothing is refused for them."""
    import torch

    if seq_lens is None:
        return torch.zeros(num_tokens, dtype=torch.bool)
    num_seqs = seq_lens.numel()
    rows = torch.arange(num_tokens)
    seq = torch.searchsorted(query_start_loc[:num_seqs].long().cpu(), rows, right=True) - 1
    return seq_lens.cpu()[seq.clamp(0, num_seqs - 1)] == 0


def direct_a2a_lse_reduce(version: Version, group: Callable[[], Any],
                          calls: dict[str, int] | None = None) -> Callable[..., None]:
    """A stand-in for ``torch.ops._C.direct_dcp_a2a_lse_reduce`` of release ``version`` over the gloo
    group ``group()`` (the DCP group's ``device_group``)."""

    def op(partial_output, partial_lse, seq_lens, query_start_loc, peer_output_ptrs, peer_lse_ptrs,
           peer_signal_ptrs, received_output, received_lse, received_signal, epoch, combined_output,
           world_size, rank, max_num_tokens, is_lse_base_on_e):
        import torch
        import torch.distributed as dist

        check_a2a_arguments(version, partial_output, partial_lse, seq_lens, query_start_loc, combined_output,
                            world_size, rank, max_num_tokens)
        if calls is not None:
            calls["direct_a2a"] = calls.get("direct_a2a", 0) + 1
        num_tokens, heads, dim = partial_output.shape
        per_rank = heads // world_size
        lse = partial_lse.float().clone()
        lse[empty_kv_rows(num_tokens, seq_lens, query_start_loc)] = float("-inf")
        send = torch.cat([partial_output.float(), lse[..., None]], -1).view(num_tokens, world_size, per_rank, dim + 1)
        send = send.transpose(0, 1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group())
        combined_output.copy_(merge(recv[..., :dim], recv[..., dim], is_lse_base_on_e))

    return op


def merge(outs: Any, lses: Any, is_lse_base_on_e: bool) -> Any:
    """The LSE-weighted merge of ``[N, T, H, D]`` partials (zero weight for ``-inf``; a row every
    source left empty is zero), in float32 as the kernel accumulates."""
    import torch

    lses = lses.float()
    if not is_lse_base_on_e:
        lses = lses * torch.log(torch.tensor(2.0))
    top = lses.amax(dim=0, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lses - top)
    total = weights.sum(dim=0, keepdim=True)
    weights = torch.where(total > 0, weights / total.clamp_min(1e-30), torch.zeros_like(weights))
    return (outs.float() * weights[..., None]).sum(dim=0)
