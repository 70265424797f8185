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


def has_check(name: str, version: Version, checks: dict[str, tuple[str, str | None]] | None = None) -> bool:
    """Release ``version`` makes check ``name`` of ``checks`` (a table of first and last release;
    :data:`A2A_CHECKS` by default)."""
    first, last = (A2A_CHECKS if checks is None else checks)[name]
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
    source left empty is zero), in float32 as the kernel accumulates. A source of zero weight is never
    read, as in the kernel ("empty shards leave stale payloads"): its payload may be anything, NaN too."""
    import torch

    lses = lses.float()
    if not is_lse_base_on_e:
        lses = lses * torch.log(torch.tensor(2.0))
    top = lses.amax(dim=0, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lses - top)
    total = weights.sum(dim=0, keepdim=True)
    weights = torch.where(total > 0, weights / total.clamp_min(1e-30), torch.zeros_like(weights))
    zero = torch.zeros((), dtype=torch.float32)
    weighted = torch.where(weights[..., None] > 0, outs.float() * weights[..., None], zero)
    return weighted.sum(dim=0)


# --------------------------------------------------------------------------------------------
# The cases the stand-in and the real op are held to (one H200: ``test_kernel_contracts.py``)
# --------------------------------------------------------------------------------------------
# Every case but its own fault carries one more on purpose, the last check of the op: a
# ``query_start_loc`` one boundary short. The op then refuses at that check at the latest, so it
# never launches and no peer is touched; a case the op accepts answers with that check's message
# (``SENTINEL``), which says every earlier check passed.
SENTINEL = "query_start_loc must contain one boundary per sequence"
TOKENS, HEADS, DIM, CAPACITY = 4, 8, 512, 8  # [T, world * heads per rank, kv_lora_rank], the workspace's T
A2A_CASES: dict[str, dict[str, Any]] = {
    "latent_partials_latent_workspace": {},
    "projected_partials_projected_workspace": {"dim": 256, "combined_dim": 256},
    # 0.33.0's projection on GLM-5's path: the workspace sized for v_head_dim, the latent merged
    "latent_partials_projected_workspace": {"combined_dim": 256},
    "over_capacity": {"tokens": CAPACITY + 1},
    "strided_lse": {"lse_stride": 2},  # 0.28.0 requires packed LSE heads; 0.29.0+ reads the stride
    "fp32_output": {"dtype": "float32"},
    "heads_not_divisible": {"heads": 7},
    "head_dim_not_multiple_of_8": {"dim": 12, "combined_dim": 12},
    "non_contiguous_combined": {"combined_transposed": True},
    "seq_lens_without_query_start_loc": {"query_start_loc": None},
    "int64_seq_lens": {"bounds_dtype": "int64"},
}


def a2a_arguments(case: str, device: str = "cpu") -> dict[str, Any]:
    """The op's arguments for ``case`` on ``device`` (keyword names of the stand-in's op)."""
    import torch

    spec = A2A_CASES[case]
    dtype = getattr(torch, spec.get("dtype", "bfloat16"))
    tokens, heads, dim = spec.get("tokens", TOKENS), spec.get("heads", HEADS), spec.get("dim", DIM)
    world = 2
    partial = torch.zeros(tokens, heads, dim, dtype=dtype, device=device)
    stride = spec.get("lse_stride", 1)
    lse = torch.zeros(tokens, heads * stride, dtype=torch.float32, device=device)[:, ::stride]
    cdim = spec.get("combined_dim", dim)
    combined = torch.zeros(tokens, heads // world, cdim, dtype=dtype, device=device)
    if spec.get("combined_transposed"):
        combined = torch.zeros(cdim, heads // world, tokens, dtype=dtype, device=device).transpose(0, 2)
    bounds = getattr(torch, spec.get("bounds_dtype", "int32"))
    seq_lens = torch.tensor([3, 5], dtype=bounds, device=device)
    qsl = spec.get("query_start_loc", "short")
    qsl = None if qsl is None else torch.tensor([0, tokens], dtype=torch.int32, device=device)  # one short
    ptrs = torch.zeros(world, dtype=torch.int64, device=device)
    return {
        "partial_output": partial, "partial_lse": lse, "seq_lens": seq_lens, "query_start_loc": qsl,
        "peer_output_ptrs": ptrs, "peer_lse_ptrs": ptrs.clone(), "peer_signal_ptrs": ptrs.clone(),
        "received_output": torch.zeros(2, world, CAPACITY, heads // world, max(dim, cdim), dtype=dtype,
                                       device=device),
        "received_lse": torch.zeros(2, world, CAPACITY, heads // world, dtype=torch.float32, device=device),
        "received_signal": torch.zeros(2, world, dtype=torch.int32, device=device),
        "epoch": torch.zeros(1, dtype=torch.int64, device=device),
        "combined_output": combined, "world_size": world, "rank": 0, "max_num_tokens": CAPACITY,
        "is_lse_base_on_e": True,
    }


def stand_in_answer(version: Version, case: str) -> str:
    """What :func:`check_a2a_arguments` of ``version`` says to ``case``: the refusal's message."""
    a = a2a_arguments(case)
    try:
        check_a2a_arguments(version, a["partial_output"], a["partial_lse"], a["seq_lens"], a["query_start_loc"],
                            a["combined_output"], a["world_size"], a["rank"], a["max_num_tokens"])
    except KernelRefusal as exc:
        return str(exc)
    return "accepted"


def real_answers(library: str) -> dict[str, str]:
    """On a CUDA machine: what the compiled ``direct_dcp_a2a_lse_reduce`` in ``library`` (a release's
    ``vllm/_C_stable_libtorch.abi3.so``) says to each case: the message of its refusal, as
    ``STD_TORCH_CHECK`` words it (the file and line stripped)."""
    import torch

    torch.ops.load_library(library)
    op = torch.ops._C.direct_dcp_a2a_lse_reduce
    answers = {}
    for case in A2A_CASES:
        a = a2a_arguments(case, "cuda")
        try:
            op(*a.values())
            torch.cuda.synchronize()
            answers[case] = "accepted"  # launched: never expected (SENTINEL)
        except RuntimeError as exc:
            text = str(exc)
            answers[case] = next((m for m in _MESSAGES if m in text), text.strip().splitlines()[-1][:300])
    return answers


_MESSAGES = (
    "direct DCP A2A only supports FP16 and BF16 output", "partial LSE must be FP32, FP16, or BF16",
    "expected output [T,H,D] and LSE [T,H]", "world_size must be greater than 1", "invalid rank",
    "partial output must have packed heads and an aligned token stride", "partial LSE must have packed heads",
    "token count exceeds symmetric buffer capacity", "attention heads must divide evenly across DCP ranks",
    "LSE shape must match attention output", "head_dim must be divisible by 8 for 16-byte stores",
    "combined output must match the contiguous CUDA input", "combined output has the wrong shape",
    "invalid symmetric staging dtypes", "peer pointer tables must be int64",
    "seq_lens and query_start_loc must be provided together", "seq_lens must be a contiguous 1-D int32 CUDA tensor",
    "query_start_loc must be a contiguous 1-D int32 CUDA tensor", SENTINEL,
)


if __name__ == "__main__":  # python kernel_contracts.py LIBRARY: the real op's answers, as JSON
    import json
    import sys

    print(json.dumps(real_answers(sys.argv[1])))
