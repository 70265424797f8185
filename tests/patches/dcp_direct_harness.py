"""N-rank CPU harness for the direct DCP workspace patches (issue 4).

Spawns ``world`` processes (default 2; any power of two) that form a real vLLM DCP group over
gloo (TP = DCP = world) and build the
real ``MLADCPManager`` with the direct (symmetric-memory) q-gather and A2A workspaces forced
on. Only GPU-only pieces are replaced, at their call boundary:

- symmetric-memory allocation / multicast probing (``_allocate``, ``_multicast_ptrs``,
  ``_symm_mem_spans_group``) -> plain CPU tensors;
- the direct kernels ``torch.ops._C.direct_dcp_q_gather`` / ``direct_dcp_a2a_lse_reduce``
  -> the same exchange over gloo: the q-gather with its capacity check (``token count exceeds
  symmetric q-gather buffer capacity``), the A2A op as ``kernel_contracts`` has it (the release's
  own argument checks, held to the compiled op on one H200, and its row-to-sequence mapping);
- the Triton pack/unpack kernels inside vLLM's NCCL ``dcp_a2a_lse_reduce`` -> torch code
  (the rest of that function, its LSE mask and its ``all_to_all_single``, runs for real).

Each scenario records which path ran, any error, and the largest deviation from the float64
reference (vLLM's ``_lse_weighted_combine`` over every rank's partials).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ranks import fatal_report, spawn_ranks

H = 4  # query/output heads per TP rank
QD = 32  # query head dim (kv_lora_rank + rope in the real model)
LD = 16  # output head dim (kv_lora_rank)


def _partials(rank: int, num_tokens: int, world: int):
    """This rank's query ``[T, H, QD]`` and partials over all ``world * H`` gathered heads."""
    import torch

    gen = torch.Generator().manual_seed(1000 * rank + num_tokens)
    q = torch.randn(num_tokens, H, QD, generator=gen).to(torch.bfloat16)
    out = torch.randn(num_tokens, world * H, LD, generator=gen).to(torch.bfloat16)
    lse = torch.randn(num_tokens, world * H, generator=gen) * 3
    return q, out, lse


def _bounds(num_tokens: int):
    """A mixed batch: two decode rows then one prefill holding the rest."""
    import torch

    if num_tokens <= 2:
        return torch.ones(num_tokens, dtype=torch.int32) * 50, torch.arange(num_tokens + 1, dtype=torch.int32)
    seq_lens = torch.tensor([50, 3, 4000], dtype=torch.int32)
    return seq_lens, torch.tensor([0, 1, 2, num_tokens], dtype=torch.int32)


def _install_standins(calls: dict[str, int]) -> None:
    import compat
    import kernel_contracts as kc
    import torch
    import torch.distributed as dist

    a2a = compat.module("dcp_alltoall")
    common = compat.module("ops_common")
    workspace_cls = compat.renamed("direct_workspace")  # 0.29.0: cp_common.DirectCPWorkspace

    def allocate(self, shape, dtype):  # symmetric memory -> CPU tensor
        storage = torch.zeros(shape, dtype=dtype)
        self._allocations.append((storage, None, [storage]))
        return storage, torch.zeros((self.num_ubatches, self.world_size), dtype=torch.int64)

    workspace_cls._allocate = allocate
    workspace_cls._multicast_ptrs = lambda self, storage: [1] * self.num_ubatches
    compat.module("cp_common")._symm_mem_spans_group = lambda group: True
    torch.accelerator.synchronize = lambda *a, **k: None

    def q_gather(local_query, output, signal, completion, epoch, world_size, rank, max_num_tokens,
                 padded_num_heads, query_mc_ptr, signal_mc_ptr):
        calls["direct_q_gather"] += 1
        if local_query.shape[0] > max_num_tokens:
            raise RuntimeError("token count exceeds symmetric q-gather buffer capacity")
        parts = [torch.empty_like(local_query) for _ in range(world_size)]
        dist.all_gather(parts, local_query.contiguous(), group=_GROUP["dcp"].device_group)
        output.copy_(torch.cat(parts, dim=1))

    a2a_reduce = kc.direct_a2a_lse_reduce(compat.vllm_version(), lambda: _GROUP["dcp"].device_group, calls)

    torch.ops._C.direct_dcp_q_gather = q_gather
    torch.ops._C.direct_dcp_a2a_lse_reduce = a2a_reduce

    class _Pack:  # Triton _dcp_a2a_pack_send_kernel[grid](...)
        def __getitem__(self, grid):
            def run(out, lse, send, *args, N, HEAD_DIM, H_PER_RANK, LSE_PACK_DIM, HAS_MASK=False,
                    NUM_SEQS_POW2=None):
                # 0.33.0 fuses the empty-shard mask into this kernel: (seq_lens, qsl, num_seqs, *strides)
                calls["nccl_a2a"] += 1
                if HAS_MASK:
                    lse = lse.clone()
                    common.mask_dcp_empty_shards_(lse, args[0], args[1])
                b = out.shape[0]
                for r in range(N):
                    heads = slice(r * H_PER_RANK, (r + 1) * H_PER_RANK)
                    send[r, :, :, :HEAD_DIM] = out[:, heads]
                    lse32 = lse[:, heads].float().contiguous()
                    send[r, :, :, HEAD_DIM:] = lse32.view(send.dtype).view(b, H_PER_RANK, LSE_PACK_DIM)
            return run

    class _Unpack:  # Triton _dcp_a2a_unpack_combine_kernel[grid](...)
        def __getitem__(self, grid):
            def run(recv, out, out_lse, *strides, N, HEAD_DIM, IS_BASE_E, RETURN_LSE, LSE_PACK_DIM):
                lse = recv[..., HEAD_DIM:].contiguous().view(torch.float32)[..., 0]
                merged = a2a._lse_weighted_combine(recv[..., :HEAD_DIM].float(), lse,
                                                   is_lse_base_on_e=IS_BASE_E)
                out.copy_(merged)
            return run

    a2a._dcp_a2a_pack_send_kernel = _Pack()
    if not hasattr(a2a.triton, "next_power_of_2"):  # vLLM's Triton placeholder on CPU (0.33.0 grid)
        a2a.triton.next_power_of_2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()
    a2a._dcp_a2a_unpack_combine_kernel = _Unpack()

    orig_gather = type(_GROUP["dcp"]).all_gather

    def all_gather(self, tensor, dim=-1):
        calls["nccl_all_gather"] += 1
        return orig_gather(self, tensor, dim)

    type(_GROUP["dcp"]).all_gather = all_gather


_GROUP: dict[str, Any] = {}

MODES: dict[str, dict[str, str]] = {"decode": {}}  # the release's own (decode) sizing


def _run_sizes(manager, rank: int, world: int, sizes: list[int], calls: dict[str, int], a2a) -> dict[str, Any]:
    import torch

    scenarios: dict[str, Any] = {}
    for n in sizes:
        rec: dict[str, Any] = {}
        q, out, lse = _partials(rank, n, world)
        before = dict(calls)
        try:
            got = manager.query_gather(q)
            ref = torch.cat([_partials(r, n, world)[0] for r in range(world)], dim=1)
            rec["q_err"] = float((got.float() - ref.float()).abs().max())
        except Exception as exc:
            rec["q_error"] = f"{type(exc).__name__}: {exc}"
        seq_lens, qsl = _bounds(n)
        try:
            got = manager.combine(out, lse.clone(), seq_lens=seq_lens, query_start_loc=qsl)
            outs = torch.stack([_partials(r, n, world)[1] for r in range(world)]).double()
            lses = torch.stack([_partials(r, n, world)[2] for r in range(world)]).double()
            ref = a2a._lse_weighted_combine(outs, lses, is_lse_base_on_e=False)[:, rank * H:(rank + 1) * H]
            rec["a2a_err"] = float((got.double() - ref).abs().max())
            rec["a2a_ref_max"] = float(ref.abs().max())
        except Exception as exc:
            rec["a2a_error"] = f"{type(exc).__name__}: {exc}"
        rec["calls"] = {k: calls[k] - before[k] for k in calls}
        scenarios[str(n)] = rec
    return scenarios


def _worker(rank: int, world: int, port: int, model_dir: str, modes: dict[str, dict[str, str]],
            sizes: list[int], out_dir: str, sys_path: list[str], user_defaults: bool = False) -> None:
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    os.environ.update({"VLLM_USE_DIRECT_DCP_A2A": "1", "VLLM_USE_DIRECT_DCP_Q_GATHER": "1"})
    import compat
    import sparse_dcp_harness as h
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        get_dcp_group,
        init_distributed_environment,
        initialize_model_parallel,
    )

    results: dict[str, Any] = {}
    try:
        # user_defaults: the DCP options a GLM-5 user who names none gets where the release lets the
        # model choose them (0.33.0: a2a, query replication); a2a spelled out where it does not
        backend = None if user_defaults and h.release_sets_model_dcp_defaults() else "a2a"
        vc = h.make_vllm_config(Path(model_dir), max_num_seqs=4, max_num_batched_tokens=64, dcp=world,
                                heads_per_rank=H, comm_backend=backend)
        results["resolved"] = {"dcp_comm_backend": vc.parallel_config.dcp_comm_backend,
                               "dcp_q_replicate": getattr(vc.parallel_config, "dcp_q_replicate", None),
                               "by_release": backend is None}
        a2a = compat.module("dcp_alltoall")
        dcp = compat.module("dcp")
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(tensor_model_parallel_size=world, decode_context_model_parallel_size=world)
            _GROUP["dcp"] = get_dcp_group()
            calls = dict.fromkeys(["direct_q_gather", "direct_a2a", "nccl_a2a", "nccl_all_gather"], 0)
            _install_standins(calls)
            for mode, mode_env in modes.items():
                os.environ.update(mode_env)
                manager = dcp.MLADCPManager(
                    vllm_config=vc, device=torch.device("cpu"), num_heads=H, query_head_dim=QD,
                    output_head_dim=LD, query_dtype=torch.bfloat16, output_dtype=torch.bfloat16,
                    padded_num_heads=None, is_lse_base_on_e=False, use_pcp=False)
                results[mode] = {"capacity": manager.max_num_tokens,
                                 "scenarios": _run_sizes(manager, rank, world, sizes, calls, a2a)}
    except Exception as exc:
        results.update(fatal_report(exc))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def run_ranks(tmp: Path, sizes: list[int], modes: dict[str, dict[str, str]] | None = None,
              world: int = 2, timeout: float = 240, user_defaults: bool = False) -> list[dict[str, Any]]:
    """Run the scenarios on ``world`` gloo ranks, one manager per mode (its environment);
    each rank's results. ``user_defaults``: the config leaves the DCP options to the release where it
    lets the model choose them (``results["resolved"]`` says what it chose).
    """
    return spawn_ranks(_worker, lambda r, port: (r, world, port, str(tmp / "model"), modes or MODES, sizes,
                                                 str(tmp), list(sys.path), user_defaults), tmp, world=world,
                       timeout=timeout)


# --------------------------------------------------------------------------------------------
# GPU: ``world`` H200s (two by default), vLLM 0.28.0's own direct A2A kernel over symmetric
# memory (no multicast).

GPU_HEADS = 16  # heads per TP rank given to the manager (fixed; world * GPU_HEADS in all)
GPU_DIM = 512  # kv_lora_rank


def _gpu_batch(kind: str, num_tokens: int, rank: int, world: int):
    """Partials of one rank (``world * GPU_HEADS`` heads) for a ``mixed`` (4 decodes + 1
    prefill) or ``prefill`` batch.

    Local KV lengths: the second decode sequence holds nothing on the odd ranks (an empty
    shard; with two ranks: rank 1).
    """
    import torch

    gen = torch.Generator().manual_seed(7919 * rank + num_tokens + len(kind))
    out = torch.randn(num_tokens, world * GPU_HEADS, GPU_DIM, generator=gen).to(torch.bfloat16)
    lse = torch.randn(num_tokens, world * GPU_HEADS, generator=gen) * 4
    if kind == "mixed":
        qsl = [0, 1, 2, 3, 4, num_tokens]
        seq_lens = [300, 0 if rank % 2 else 1, 40, 7, 5000]
    else:
        qsl = [0, num_tokens // 3, num_tokens]
        seq_lens = [num_tokens // 3, 9000]
    return out, lse, torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32)


def _gpu_reference(kind: str, num_tokens: int, rank: int, world: int):
    """float64 merge of every rank's partials (empty shards masked), this rank's head slice."""
    import compat
    import torch

    a2a = compat.module("dcp_alltoall")
    common = compat.module("ops_common")
    outs, lses = [], []
    for r in range(world):
        out, lse, seq_lens, qsl = _gpu_batch(kind, num_tokens, r, world)
        lse = lse.double()
        common.mask_dcp_empty_shards_(lse, seq_lens, qsl)
        outs.append(out.double())
        lses.append(lse)
    ref = a2a._lse_weighted_combine(torch.stack(outs), torch.stack(lses), is_lse_base_on_e=False)
    return ref[:, rank * GPU_HEADS:(rank + 1) * GPU_HEADS]


def gpu_worker(rank: int, world: int, port: int, model_dir: str, out_file: str) -> None:
    """One rank of the GPU check; writes a JSON report to ``out_file`` + rank suffix."""
    import time

    os.environ.update(VLLM_USE_DIRECT_DCP_A2A="1", VLLM_USE_DIRECT_DCP_Q_GATHER="0",
                      NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    import torch

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    import compat
    import sparse_dcp_harness as h
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_dcp_group, init_distributed_environment, initialize_model_parallel

    if not hasattr(torch.ops._C, "direct_dcp_a2a_lse_reduce"):
        import vllm

        torch.ops.load_library(str(Path(vllm.__file__).parent / "_C_stable_libtorch.abi3.so"))
    dcp = compat.module("dcp")
    a2a = compat.module("dcp_alltoall")
    common = compat.module("ops_common")
    report: dict[str, Any] = {"rank": rank, "checks": [], "timing": []}
    vc = h.make_vllm_config(Path(model_dir), max_num_seqs=8, max_num_batched_tokens=8192, device="cuda",
                            dcp=world, heads_per_rank=GPU_HEADS)
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="nccl",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tensor_model_parallel_size=world, decode_context_model_parallel_size=world)
        group = get_dcp_group()

        # a config whose decode capacity is every batched token: the direct kernel timed at sizes
        # the decode-sized workspace sends to NCCL
        vc_full = h.make_vllm_config(Path(model_dir), max_num_seqs=8192, max_num_batched_tokens=8192,
                                     device="cuda", dcp=world, heads_per_rank=GPU_HEADS)

        def manager(config):
            return dcp.MLADCPManager(
                vllm_config=config, device=device, num_heads=GPU_HEADS, query_head_dim=GPU_DIM + 64,
                output_head_dim=GPU_DIM, query_dtype=torch.bfloat16, output_dtype=torch.bfloat16,
                padded_num_heads=None, is_lse_base_on_e=False, use_pcp=False)

        decode_mgr = manager(vc)
        full_mgr = manager(vc_full)
        cap = decode_mgr.max_num_tokens
        report["capacity"] = {"decode": cap, "all_batched_tokens": full_mgr.max_num_tokens}
        ws = decode_mgr.combine.args[0]  # the DirectDCPA2AWorkspace behind the patched combine
        full_ws = full_mgr.combine.args[0]
        report["workspaces"] = [type(ws).__name__, type(full_ws).__name__]

        def on_gpu(kind, n):
            out, lse, seq_lens, qsl = _gpu_batch(kind, n, rank, world)
            return out.to(device), lse.to(device), seq_lens.to(device), qsl.to(device)

        def err(got, kind, n):
            ref = _gpu_reference(kind, n, rank, world)
            return float((got.double().cpu() - ref).abs().max()), float(ref.abs().max())

        def record(name, kind, n, fn):
            out, lse, seq_lens, qsl = on_gpu(kind, n)
            row: dict[str, Any] = {"check": name, "batch": kind, "tokens": n}
            try:
                got = fn(out, lse.clone(), seq_lens, qsl)
                torch.cuda.synchronize()
                row["max_err"], row["ref_max"] = err(got, kind, n)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            group.barrier()
            report["checks"].append(row)

        unpatched = lambda o, lse_, s, q: ws.lse_reduce(o, lse_, False, seq_lens=s, query_start_loc=q)  # noqa: E731
        patched = lambda o, lse_, s, q: decode_mgr.combine(o, lse_, seq_lens=s, query_start_loc=q)  # noqa: E731
        nccl_a2a = lambda o, lse_, s, q: a2a.dcp_a2a_lse_reduce(  # noqa: E731
            o, lse_, group, is_lse_base_on_e=False, seq_lens=s, query_start_loc=q)
        ag_rs = lambda o, lse_, s, q: common.cp_lse_ag_out_rs(  # noqa: E731
            o, lse_, group, is_lse_base_on_e=False, seq_lens=s, query_start_loc=q)
        for n in (cap, cap + 1):
            record("unpatched_direct", "mixed", n, unpatched)  # 0.28.0's combine = ws.lse_reduce
            record("patched_combine", "mixed", n, patched)
        for kind in ("mixed", "prefill"):
            for name, fn in (("ag_rs", ag_rs), ("nccl_a2a", nccl_a2a), ("direct_a2a", unpatched)):
                record(name, kind, cap, fn)
            record("patched_combine", kind, 4 * cap + 3, patched)

        def timed(fn, n, iters=30):
            out, lse, seq_lens, qsl = on_gpu("prefill", n)
            for _ in range(3):
                fn(out, lse.clone(), seq_lens, qsl)
            torch.cuda.synchronize()
            group.barrier()
            samples = []
            for _ in range(iters):
                lse_c = lse.clone()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(out, lse_c, seq_lens, qsl)
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) * 1000)
            return sorted(samples)[len(samples) // 2]

        full_direct = lambda o, lse_, s, q: full_ws.lse_reduce(o, lse_, False, seq_lens=s, query_start_loc=q)  # noqa: E731
        t0 = time.time()
        for n in (cap, 512, 2048, 8192):
            report["timing"].append({"tokens": n, "direct_us": timed(full_direct, n),
                                     "nccl_a2a_us": timed(nccl_a2a, n), "ag_rs_us": timed(ag_rs, n)})
        report["timing_wall_s"] = time.time() - t0
    Path(f"{out_file}.rank{rank}.json").write_text(json.dumps(report, indent=1))
