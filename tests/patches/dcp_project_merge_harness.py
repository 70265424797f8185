"""N-rank harness for dcp-project-before-merge (issue 9): real DCP group, real combines.

Each of ``world`` ranks (default 2; any power of two) forms a real vLLM DCP group
(TP = DCP = world; gloo on CPU, NCCL on GPU), builds an
``MLAAttention`` without ``__init__`` (which needs CUDA kernels) but runs its real
``process_weights_after_loading`` (so ``W_UV`` is all-gathered over the DCP group by the
patched code) and its real ``_v_up_proj``, with the real ``MLADCPManager.project_combine``
and combines of every transport:

- ``ag_rs``: ``cp_lse_ag_out_rs`` (its all-gather and reduce-scatter run for real);
- ``nccl_a2a``: ``dcp_a2a_lse_reduce`` (mask and ``all_to_all_single`` for real);
- ``direct_a2a``: the direct symmetric-memory kernel (GPU: vLLM 0.28.0's compiled kernel).

On CPU the GPU-only kernels are replaced at their call boundary: the direct kernels and the
NCCL A2A's Triton pack/unpack by ``dcp_direct_harness``'s stand-ins, and the ag_rs Triton
correction kernel by the same arithmetic in torch. Both paths (merge-then-project, the 0.28.0
order, and project-then-merge) are compared with a float64 reference: every rank's latent
partials merged by LSE (rows masked by sequence bounds; sparse rows without a local index
zero-filled with LSE -inf, as the FlashMLA sparse DCP decode leaves them), then projected
through this rank's heads of ``W_UV``. On a GPU the projected merge also runs with the fused
Triton kernels (``VLLM_DCP_PROJECT_FUSED=1``, dcp-project-before-merge-fused) and captured in a
CUDA graph, replayed twice (both parity slots of the direct workspace).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

from ranks import fatal_report, spawn_ranks

# Batches: (name, query lens, local seq lens of ranks 0 and 1, rows with no local top-k on
# ranks 0 and 1); ranks 2, 3, ... are derived from these by ``rank_batch``. Rows with no local
# index are zero-filled with LSE -inf, as the FlashMLA sparse DCP decode leaves them. Every
# row has local KV on rank 0 or rank 1. ``one_token`` is below ag_rs's project-first bound.
BATCHES: list[tuple[str, list[int], list[list[int]], list[list[int]]]] = [
    ("one_token", [1], [[33], [20]], [[], []]),
    ("decode", [1, 1, 1, 1, 1], [[300, 1, 40, 7, 12], [290, 0, 41, 6, 12]], [[], []]),
    ("mtp", [3, 3, 3], [[70, 9, 130], [69, 8, 0]], [[], []]),
    ("mixed", [1, 1, 14], [[50, 3, 4000], [49, 2, 3999]], [[], []]),
    ("forced_mqa_prefill", [5, 12], [[5, 9000], [4, 9000]], [[], []]),
    ("empty_sparse_rows", [1, 1, 1, 1, 1, 1], [[80] * 6, [80] * 6], [[0, 3], [1, 4, 5]]),
]


def rank_batch(name: str, rank: int) -> tuple[list[int], list[int], list[int]]:
    """(query lens, local seq lens, rows with no local top-k) of batch ``name`` on ``rank``.

    Ranks 0 and 1 hold the table's data. Rank ``r >= 2`` holds rank ``r % 2``'s seq lens
    shortened by ``r // 2`` (an empty shard stays empty, a one-token shard may become one) and,
    in a batch with empty sparse rows, the rows ``i`` with ``(i + r) % 3 == 0``: deterministic in
    (batch, rank), independent of the rank count.
    """
    _, query_lens, seq_lens, empty = next(b for b in BATCHES if b[0] == name)
    if rank < 2:
        return query_lens, seq_lens[rank], empty[rank]
    lens = [max(0, s - rank // 2) for s in seq_lens[rank % 2]]
    rows = [i for i in range(sum(query_lens)) if (i + rank) % 3 == 0] if any(empty) else []
    return query_lens, lens, rows


def batch_tensors(name: str, rank: int, heads: int, lora: int, seed: int = 0):
    """(out [T, heads, L] bf16, lse [T, heads] fp32, seq_lens, query_start_loc, valid_counts).

    Rows without a local index (``valid_counts == 0``) are 0 with LSE -inf, as the backend
    hands them to the combine.
    """
    import torch

    query_lens, seq_lens, empty = rank_batch(name, rank)
    num_tokens = sum(query_lens)
    gen = torch.Generator().manual_seed(7919 * rank + 31 * num_tokens + seed + len(name))
    out = torch.randn(num_tokens, heads, lora, generator=gen).to(torch.bfloat16)
    lse = torch.randn(num_tokens, heads, generator=gen) * 3
    valid = torch.full((num_tokens,), 5, dtype=torch.int32)
    for row in empty:
        valid[row] = 0
        out[row] = 0.0
        lse[row] = float("-inf")
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return out, lse, torch.tensor(seq_lens, dtype=torch.int32), qsl, valid


def weights(rank: int, heads: int, nope: int, lora: int, v: int):
    """This rank's ``kv_b_proj`` weight ``[heads * (nope + v), lora]`` (bf16)."""
    import torch

    gen = torch.Generator().manual_seed(104729 + rank)
    return (torch.randn(heads * (nope + v), lora, generator=gen) / lora**0.5).to(torch.bfloat16)


def reference(name: str, rank: int, world: int, heads: int, nope: int, lora: int, v: int):
    """float64: merge all ranks' latent partials by LSE, then project this rank's heads."""
    import compat
    import torch

    a2a = compat.module("dcp_alltoall")
    common = compat.module("ops_common")
    outs, lses = [], []
    for r in range(world):
        out, lse, seq_lens, qsl, _ = batch_tensors(name, r, world * heads, lora)
        lse = lse.double()
        common.mask_dcp_empty_shards_(lse, seq_lens, qsl)
        out = out.double()
        outs.append(out)
        lses.append(lse)
    merged = a2a._lse_weighted_combine(torch.stack(outs), torch.stack(lses), is_lse_base_on_e=True)
    mine = merged[:, rank * heads:(rank + 1) * heads]
    w_uv = weights(rank, heads, nope, lora, v).double().T.reshape(lora, heads, nope + v)[..., nope:]
    return torch.einsum("bnl,lnv->bnv", mine, w_uv).reshape(mine.shape[0], heads * v)


def make_layer(heads: int, nope: int, lora: int, v: int, rank: int, device: Any, project: bool):
    """An ``MLAAttention`` with the state the merge reads; real weight processing."""
    import compat
    import sparse_dcp_harness
    import torch
    from vllm.config import get_current_vllm_config

    mla = compat.module("mla_attention")
    layer = mla.MLAAttention.__new__(mla.MLAAttention)
    torch.nn.Module.__init__(layer)
    kv_b_proj = torch.nn.Linear(lora, heads * (nope + v), bias=False, device=device,
                                dtype=torch.bfloat16)
    kv_b_proj.weight.data.copy_(weights(rank, heads, nope, lora, v))
    kv_b_proj.quant_method = None
    for key, value in dict(
        num_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=64, kv_lora_rank=lora,
        v_head_dim=v, q_pad_num_heads=None, use_pcp=False, dcp_q_replicate=False,
        is_aiter_triton_fp4_bmm_enabled=False, is_aiter_triton_fp8_bmm_enabled=False,
        quant_config=None, layer_name="model.layers.0.self_attn.attn", kv_b_proj=kv_b_proj,
        dcp_project_before_merge=project, W_UV_dcp=None,
        _vllm_config=get_current_vllm_config() if project else None,
    ).items():
        setattr(layer, key, value)
    for scale in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
        setattr(layer, scale, torch.ones((), device=device))
    # 0.29.0+: process_weights_after_loading first lets the backend impl pack its own
    # weights (a no-op unless overridden) and checks the AMX path; unused by 0.28.0.
    layer.impl = types.SimpleNamespace(process_weights_after_loading=lambda act_dtype: None)
    layer.is_amx_bmm_enabled = False
    sparse_dcp_harness.process_weights_after_loading(layer, torch.bfloat16)
    return layer


def _install_ag_rs_standin() -> None:
    """CPU: ``_correct_attn_cp_out_kernel`` (Triton) as torch, via ``CPTritonContext``."""
    import compat
    import torch

    common = compat.module("ops_common")

    def call_kernel(self, kernel, grid, out, new_out, lses, vlse, *rest, HEAD_DIM, N_ROUNDED,
                    IS_BASE_E):
        lse_idx = rest[-1]
        lse = lses.float()
        lse = torch.where(torch.isnan(lse) | (lse == float("inf")), float("-inf"), lse)
        mx = lse.max(0).values
        mx = torch.where(mx == float("-inf"), 0.0, mx)
        exp = torch.exp if IS_BASE_E else torch.exp2
        log = torch.log if IS_BASE_E else torch.log2
        final = log(exp(lse - mx).sum(0)) + mx
        vlse.copy_(final)
        factor = exp(lse[lse_idx] - final)
        factor = torch.where(torch.isnan(factor), 0.0, factor)[..., None]
        res = torch.where(factor == 0, 0.0, out.float() * factor)
        new_out.copy_(res)

    common.CPTritonContext.call_kernel = call_kernel
    if hasattr(common, "_CORRECT_ATTN_CP_OUT_KERNEL"):
        # 0.29.0+: correct_attn_out launches a jit-warmup kernel object, not through the
        # context; stand in for the whole function with the same arithmetic.
        def correct_attn_out(out, lses, cp_rank, ctx=None, is_lse_base_on_e=True):
            vlse = torch.empty(lses.shape[1:], dtype=lses.dtype, device=lses.device)
            call_kernel(None, None, None, out, out, lses, vlse, cp_rank, HEAD_DIM=out.shape[-1],
                        N_ROUNDED=lses.shape[0], IS_BASE_E=is_lse_base_on_e)
            return out, vlse

        common.correct_attn_out = correct_attn_out


def _graph_err(mgr, w_uv, out, lse, seq_lens, qsl, like, ref) -> float:
    """Max error of ``project_combine`` captured in a CUDA graph and replayed twice.

    Under capture the transports take the paths decode takes in production (e.g. the direct
    a2a's fused Triton path, which eager steps below a few thousand tokens leave to the
    compiled kernel); two replays use both parity slots of the direct workspace.
    """
    import torch

    lse_g = lse.clone()
    got = torch.full_like(like, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mgr.project_combine(out, lse_g, w_uv, out=got, seq_lens=seq_lens, query_start_loc=qsl)
    err = 0.0
    for _ in range(2):
        lse_g.copy_(lse)
        got.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = max(err, float((got.double().cpu() - ref).abs().max()))
    return err


def worker(rank: int, world: int, port: int, model_dir: str, out_dir: str, sys_path: list[str],
           device_kind: str, heads: int, nope: int, lora: int, v: int) -> None:
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    report: dict[str, Any] = {"rank": rank, "device": device_kind, "checks": []}
    try:
        import torch

        gpu = device_kind == "cuda"
        if gpu:
            torch.cuda.set_device(rank)
        device = torch.device("cuda", rank) if gpu else torch.device("cpu")
        import compat
        import sparse_dcp_harness as h
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import (
            get_dcp_group,
            init_distributed_environment,
            initialize_model_parallel,
        )

        if gpu and not hasattr(torch.ops._C, "direct_dcp_a2a_lse_reduce"):
            import vllm

            torch.ops.load_library(str(Path(vllm.__file__).parent / "_C_stable_libtorch.abi3.so"))
        dcp = compat.module("dcp")
        vc = h.make_vllm_config(Path(model_dir), max_num_seqs=8, max_num_batched_tokens=64,
                                device=device_kind, dcp=world, heads_per_rank=heads)
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                         backend="nccl" if gpu else "gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(tensor_model_parallel_size=world,
                                      decode_context_model_parallel_size=world)
            group = get_dcp_group()
            if not gpu:
                import dcp_direct_harness as dh

                dh._GROUP["dcp"] = group
                dh._install_standins(dict.fromkeys(
                    ["direct_q_gather", "direct_a2a", "nccl_a2a", "nccl_all_gather"], 0))
                _install_ag_rs_standin()
            layer = make_layer(heads, nope, lora, v, rank, device, project=True)
            w_uv_dcp = compat.added(layer, "W_UV_dcp")  # gathered by the patched weight processing
            report["W_UV_dcp_shape"] = list(w_uv_dcp.shape) if w_uv_dcp is not None else None

            def manager(transport: str, head_dim: int, fused: bool = False):
                vc.parallel_config.dcp_comm_backend = "ag_rs" if transport == "ag_rs" else "a2a"
                os.environ["VLLM_USE_DIRECT_DCP_A2A"] = "1" if transport == "direct_a2a" else "0"
                os.environ["VLLM_DCP_PROJECT_FUSED"] = "1" if fused else "0"
                dcp.get_direct_dcp_a2a_workspace.cache_clear()
                return dcp.MLADCPManager(
                    vllm_config=vc, device=device, num_heads=heads, query_head_dim=lora + 64,
                    output_head_dim=head_dim, query_dtype=torch.bfloat16,
                    output_dtype=torch.bfloat16, padded_num_heads=None, is_lse_base_on_e=True,
                    use_pcp=False)

            for transport, fused in [(t, f) for t in ("ag_rs", "nccl_a2a", "direct_a2a")
                                     for f in ((False, True) if gpu else (False,))]:
                latent_mgr, projected_mgr = manager(transport, lora), manager(transport, v, fused)
                kinds = [getattr(m.combine, "func", m.combine).__name__
                         for m in (latent_mgr, projected_mgr)]
                fused_fn = getattr(projected_mgr, "fused_project_combine", None)
                kinds.append(getattr(fused_fn, "func", fused_fn).__name__ if fused_fn is not None
                             else None)
                for name, *_ in BATCHES:
                    out, lse, seq_lens, qsl, _ = (
                        t.to(device) for t in batch_tensors(name, rank, world * heads, lora))
                    ref = reference(name, rank, world, heads, nope, lora, v)
                    row: dict[str, Any] = {"transport": transport, "fused": fused, "batch": name,
                                           "tokens": out.shape[0], "combine": kinds,
                                           "project_first_min_tokens": getattr(
                                               projected_mgr, "project_first_min_tokens", None),
                                           "ref_max": float(ref.abs().max())}
                    try:
                        # 0.28.0's order: merge in latent space, then project.
                        merged = latent_mgr.combine(out.clone(), lse.clone(), seq_lens=seq_lens,
                                                    query_start_loc=qsl)
                        base = torch.empty(out.shape[0], heads * v, dtype=torch.bfloat16, device=device)
                        layer._v_up_proj(merged, out=base)
                        row["baseline_err"] = float((base.double().cpu() - ref).abs().max())
                        # Project, then merge: what forward_impl hands the manager.
                        got = torch.full((out.shape[0], heads * v), float("nan"),
                                         dtype=torch.bfloat16, device=device)
                        projected_mgr.project_combine(out, lse.clone(), w_uv_dcp, out=got,
                                                      seq_lens=seq_lens, query_start_loc=qsl)
                        row["projected_err"] = float((got.double().cpu() - ref).abs().max())
                        if gpu:  # decode runs under CUDA graphs: the captured path, replayed twice
                            row["projected_graph_err"] = _graph_err(projected_mgr, w_uv_dcp, out, lse,
                                                                    seq_lens, qsl, got, ref)
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {exc}"
                    if gpu:
                        torch.cuda.synchronize()
                    group.barrier()
                    report["checks"].append(row)
    except Exception as exc:
        report.update(fatal_report(exc))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))


def run_ranks(tmp: Path, device_kind: str = "cpu", dims: tuple[int, int, int, int] = (4, 16, 64, 32),
              world: int = 2, timeout: float = 240) -> list[dict[str, Any]]:
    """Run :func:`worker` on ``world`` spawned ranks; each rank's report (asserts none is fatal).

    ``dims`` = (heads per rank, qk_nope_head_dim, kv_lora_rank, v_head_dim); the ranks hold
    ``world * heads`` heads in all (TP = DCP = ``world``).
    """
    return spawn_ranks(worker, lambda r, port: (r, world, port, str(tmp / "model"), str(tmp), list(sys.path),
                                                device_kind, *dims), tmp, world=world, timeout=timeout)
