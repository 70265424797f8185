"""DCP with replicated queries (``dcp_q_replicate``), the decode path of vLLM 0.33.0's GLM-5 defaults.

vLLM 0.33.0's ``GlmMoeDsaForCausalLM.verify_and_update_config`` sets DCP to the a2a combine with
query replication unless the user sets them (upstream #50382): every rank of the DCP group
computes the query of all the group's heads itself (``DCPGroupColumnParallelLinear``), absorbs it
through ``W_UK_T_dcp_qrep`` (``W_UK_T`` all-gathered over the DCP group at weight processing) and
skips the query all-gather; the partial outputs then go through the same combine as with the
all-gather. Our tests of dcp-project-before-merge before this file handed the merge ready-made
partials or an all-gathered query. Here the partials come from attention itself:

- :func:`shard_attention`: MLA decode attention in float64 over one rank's interleaved KV shard
  (token ``t`` on rank ``t % dcp``, interleave 1), causal within a multi-token (MTP) query; it
  replaces the decode kernel at its boundary. With ``rank=None`` it attends over the whole KV: the
  reference of :func:`reference` (what a DCP 1 engine computes), projected through this rank's
  ``W_UV``;
- :func:`make_qrep_layer`: the ``sparse_dcp_harness`` layer (vLLM's real ``forward_impl``, rank 0,
  the other ranks simulated) with vLLM's real ``process_weights_after_loading`` under query
  replication; only the DCP group's all-gather is replaced at its boundary (every rank's weights in
  rank order, which is what it returns);
- :func:`worker`: ``world`` gloo ranks, the real all-gather at weight processing and the real
  combines of ``MLADCPManager`` (ag_rs, NCCL a2a, the direct a2a with ``dcp_direct_harness``'s
  kernel stand-in), each rank attending over its own shard with the same replicated query.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

from ranks import fatal_report, spawn_ranks

# (query lens, global seq lens) per batch: single-token decodes, and MTP verification steps (3
# tokens each, kept as decodes under DCP with interleave 1). Every row sees tokens on every rank.
BATCHES: dict[str, tuple[list[int], list[int]]] = {
    "decode": ([1, 1, 1], [90, 5, 40]),
    "mtp": ([3, 3], [70, 130]),
}
ROPE = 8  # qk_rope_head_dim of the two-rank check (the single-process layer uses sparse_dcp_harness.ROPE)


def kv_cache(batch: str, lora: int, rope: int, seed: int = 0):
    """Per request, the latent KV ``[S, lora]`` and its rope part ``[S, rope]`` (bf16), the same on
    every rank (each rank reads its own shard of it)."""
    import torch

    _, seq_lens = BATCHES[batch]
    gen = torch.Generator().manual_seed(1000 + seed + len(batch))
    return ([torch.randn(s, lora, generator=gen).to(torch.bfloat16) for s in seq_lens],
            [torch.randn(s, rope, generator=gen).to(torch.bfloat16) for s in seq_lens])


def replicated_query(batch: str, heads: int, nope: int, rope: int, seed: int = 0):
    """The query of every head of the DCP group ``[T, heads, nope + rope]`` (bf16): what
    ``DCPGroupColumnParallelLinear`` gives every rank of the group alike."""
    import torch

    query_lens, _ = BATCHES[batch]
    gen = torch.Generator().manual_seed(77 + seed + len(batch))
    return torch.randn(sum(query_lens), heads, nope + rope, generator=gen).to(torch.bfloat16)


def local_seq_lens(batch: str, rank: int, world: int) -> list[int]:
    """The tokens of each request on ``rank``'s interleaved shard."""
    _, seq_lens = BATCHES[batch]
    return [len(range(rank, s, world)) for s in seq_lens]


def shard_attention(q_abs, batch: str, kv, pe, rank: int | None, world: int, scale: float):
    """MLA decode attention of the absorbed query ``q_abs`` ``[T, H, lora + rope]`` over ``rank``'s
    shard (``None``: every token): (out ``[T, H, lora]``, natural-log LSE ``[T, H]``), float64."""
    import torch

    query_lens, seq_lens = BATCHES[batch]
    num_tokens, heads, _ = q_abs.shape
    lora = kv[0].shape[-1]
    out = torch.zeros(num_tokens, heads, lora, dtype=torch.float64)
    lse = torch.full((num_tokens, heads), float("-inf"), dtype=torch.float64)
    row = 0
    for i, (qlen, slen) in enumerate(zip(query_lens, seq_lens, strict=True)):
        keys = torch.cat([kv[i], pe[i]], dim=-1).double()
        values = kv[i].double()
        pos = torch.arange(slen)
        for j in range(qlen):
            seen = pos <= slen - qlen + j  # causal within the MTP step
            if rank is not None:
                seen &= pos % world == rank
            scores = torch.einsum("hd,sd->hs", q_abs[row].double(), keys[seen]) * scale
            lse[row] = torch.logsumexp(scores, dim=-1)
            out[row] = torch.softmax(scores, dim=-1) @ values[seen]
            row += 1
    return out, lse


def split_weights(rank: int, heads: int, nope: int, lora: int, v: int):
    """(W_UK ``[lora, heads, nope]``, W_UV ``[lora, heads, v]``) of ``rank``'s ``kv_b_proj``, float64,
    split the way ``kv_b_proj``'s output is laid out (``heads x (nope + v)``)."""
    import dcp_project_merge_harness as pm

    w = pm.weights(rank, heads, nope, lora, v).double().T.reshape(lora, heads, nope + v)
    return w[..., :nope], w[..., nope:]


def reference(batch: str, q_rep, kv, pe, rank: int, world: int, heads: int, nope: int, lora: int, v: int,
              scale: float):
    """float64, from the replicated query and every rank's ``kv_b_proj``: absorb with the group's
    W_UK, attend over all tokens, project this rank's heads by its W_UV: ``[T, heads * v]``."""
    import torch

    w_uk = torch.cat([split_weights(r, heads, nope, lora, v)[0] for r in range(world)], dim=1)
    q = q_rep.double()
    q_abs = torch.cat([torch.einsum("bhp,lhp->bhl", q[..., :nope], w_uk), q[..., nope:]], dim=-1)
    out, _ = shard_attention(q_abs, batch, kv, pe, None, world, scale)
    mine = out[:, rank * heads:(rank + 1) * heads]
    w_uv = split_weights(rank, heads, nope, lora, v)[1]
    return torch.einsum("bnl,lnv->bnv", mine, w_uv).reshape(out.shape[0], heads * v)


def process_weights(layer, rank: int, heads: int, nope: int, lora: int, v: int, *, qrep: bool,
                    project: bool) -> None:
    """Give ``layer`` rank ``rank``'s ``kv_b_proj`` and run vLLM's real ``process_weights_after_loading``
    with query replication ``qrep`` and the project-before-merge switch ``project`` (what ``__init__``
    sets up; ``W_UK_T_dcp_qrep`` and, patched, ``W_UV_dcp`` come from the DCP group's all-gather)."""
    import dcp_project_merge_harness as pm
    import sparse_dcp_harness as h
    import torch

    kv_b_proj = torch.nn.Linear(lora, heads * (nope + v), bias=False, dtype=torch.bfloat16)
    kv_b_proj.weight.data.copy_(pm.weights(rank, heads, nope, lora, v))
    kv_b_proj.quant_method = None
    for name in ("W_UK_T", "W_UV", "W_UK_T_dcp_qrep"):  # made here, from kv_b_proj
        layer.__dict__.pop(name, None)
    for key, value in dict(kv_b_proj=kv_b_proj, dcp_q_replicate=qrep, dcp_project_before_merge=project,
                           quant_config=None, num_heads=heads, qk_nope_head_dim=nope, kv_lora_rank=lora,
                           v_head_dim=v, q_pad_num_heads=None, use_pcp=False, is_amx_bmm_enabled=False,
                           is_aiter_triton_fp4_bmm_enabled=False, is_aiter_triton_fp8_bmm_enabled=False).items():
        setattr(layer, key, value)
    for scale in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
        setattr(layer, scale, torch.ones(()))
    if project and getattr(layer, "_vllm_config", None) is None:  # __init__ keeps the config it ran under
        from vllm.config import get_current_vllm_config

        layer._vllm_config = get_current_vllm_config()
    if not hasattr(layer, "impl"):
        layer.impl = types.SimpleNamespace()
    layer.impl.process_weights_after_loading = lambda act_dtype: None  # 0.29.0+ calls the backend's first
    h.process_weights_after_loading(layer, torch.bfloat16)


class GroupStandIn:
    """The DCP group at its collective boundary for weight processing: ``all_gather`` returns every
    rank's copy of the tensor it is given, in rank order (``ranks[r]``: that rank's processed layer)."""

    def __init__(self, ranks: list[Any]) -> None:
        self.ranks = ranks
        self.gathered: list[str] = []

    def all_gather(self, tensor, dim: int = -1):
        import torch

        for name in ("W_UK_T", "W_UV"):
            if torch.equal(tensor, getattr(self.ranks[0], name).contiguous()):
                self.gathered.append(name)
                return torch.cat([getattr(r, name).contiguous() for r in self.ranks], dim=dim)
        raise AssertionError(f"an all-gather of a tensor of shape {tuple(tensor.shape)} at weight processing")


def make_qrep_layer(vllm_config, layer_name: str, recorder, *, project: bool, set_attr) -> tuple[Any, dict]:
    """rank 0's layer of ``sparse_dcp_harness`` (real ``forward_impl``) under query replication, its
    weights processed by vLLM with the DCP group's all-gather at its boundary; its decode kernel is
    :func:`shard_attention` over every rank's shard of :func:`kv_cache`, the other ranks' partials in
    ``recorder``; its combine the a2a contract (each rank gets its heads' partials from every rank,
    merged by LSE; projected peers use the same gathered ``W_UV``). ``set_attr``: monkeypatch.setattr.

    Returns (layer, seen): ``seen`` records the combine's head dim and query-gather calls."""
    import math

    import compat
    import dcp_project_merge_harness as pm
    import sparse_dcp_harness as h
    import torch

    world, heads = h.DCP, h.NUM_HEADS
    with compat.setup("the query-replication layer (sparse_dcp_harness) and every rank's weights"):
        layer = h.make_layer(vllm_config, layer_name, recorder)
        ranks = [pm.make_layer(heads, h.NOPE, h.LORA, h.V, r, torch.device("cpu"), project=False)
                 for r in range(world)]
    group = GroupStandIn(ranks)
    set_attr(compat.module("mla_attention"), "get_dcp_group", lambda: group)
    process_weights(layer, 0, heads, h.NOPE, h.LORA, h.V, qrep=True, project=project)
    seen: dict[str, Any] = {"query_gather": 0, "dims": [], "gathered": group.gathered}
    scale = 1 / math.sqrt(h.LORA + h.ROPE)
    state: dict[str, Any] = {}

    def forward_mqa(q, kv_cache_, attn_metadata, layer_):  # the decode kernel's boundary
        q = torch.cat(q, dim=-1) if isinstance(q, tuple) else q
        assert q.shape[1] == world * heads, q.shape
        kv, pe = state["kv"]
        partials = [shard_attention(q, state["batch"], kv, pe, r, world, scale) for r in range(world)]
        recorder.peer_outs[:] = [o.to(torch.bfloat16) for o, _ in partials[1:]]
        recorder.peer_lses[:] = [lse.float() for _, lse in partials[1:]]
        return partials[0][0].to(torch.bfloat16), partials[0][1].float()

    def query_gather(q):
        seen["query_gather"] += 1
        return torch.cat([q] * world, dim=1)

    def combine(partial_output, partial_lse, *, seq_lens, query_start_loc):
        a2a = compat.module("dcp_alltoall")
        dim = partial_output.shape[-1]
        seen["dims"].append(dim)
        peers = recorder.peer_outs
        if dim != h.LORA:  # projected: every peer projects its partial through the same gathered W_UV
            peers = [torch.einsum("bhl,hlv->bhv", p.double(), layer.W_UV_dcp.double()).to(p.dtype) for p in peers]
        lse = partial_lse.clone()
        compat.module("ops_common").mask_dcp_empty_shards_(lse, seq_lens, query_start_loc)
        merged = a2a._lse_weighted_combine(torch.stack([partial_output, *peers]).double(),
                                           torch.stack([lse, *recorder.peer_lses]).double(), is_lse_base_on_e=True)
        return merged[:, :heads].to(partial_output.dtype)  # rank 0's heads

    layer.impl.forward_mqa = forward_mqa
    layer.dcp_manager.query_gather = query_gather
    layer.dcp_manager.combine = combine
    layer.qrep_state = state
    return layer, seen


def run_qrep_forward(layer, metadata, batch: str, seed: int = 0):
    """vLLM's real ``forward_impl`` for one decode step under query replication: the replicated query
    goes in as ``q_dcp_replicated``, this rank's heads of it as ``q`` (``_local_view``). Returns
    (output ``[T, heads * v]`` float32, the replicated query, the KV)."""
    import compat
    import sparse_dcp_harness as h
    import torch

    q_rep = replicated_query(batch, h.DCP * h.NUM_HEADS, h.NOPE, h.ROPE, seed)
    kv = kv_cache(batch, h.LORA, h.ROPE, seed)
    layer.qrep_state.update(batch=batch, kv=kv)
    num_tokens = q_rep.shape[0]
    gen = torch.Generator().manual_seed(5)
    new_kv = torch.randn(num_tokens, h.LORA, generator=gen).to(torch.bfloat16)  # this step's rows: written by
    new_pe = torch.randn(num_tokens, h.ROPE, generator=gen).to(torch.bfloat16)  # forward(), unused here
    output = torch.zeros(num_tokens, h.NUM_HEADS * h.V, dtype=torch.bfloat16)
    with compat.exercising("MLAAttention.forward_impl under query replication"):
        layer.forward_impl(q_rep[:, :h.NUM_HEADS].contiguous(), new_kv, new_pe, torch.empty(0), metadata,
                           output=output, q_dcp_replicated=q_rep)
    return output.float(), q_rep, kv


# --------------------------------------------------------------------------------------------
# world gloo ranks: the real all-gather at weight processing, the real combines
# --------------------------------------------------------------------------------------------
def worker(rank: int, world: int, port: int, model_dir: str, out_dir: str, sys_path: list[str],
           heads: int, nope: int, lora: int, v: int) -> None:
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    report: dict[str, Any] = {"rank": rank, "checks": []}
    try:
        import math

        import compat
        import dcp_direct_harness as dh
        import dcp_project_merge_harness as pm
        import sparse_dcp_harness as h
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import (
            get_dcp_group,
            init_distributed_environment,
            initialize_model_parallel,
        )

        dcp = compat.module("dcp")
        mla = compat.module("mla_attention")
        vc = h.make_vllm_config(Path(model_dir), max_num_seqs=8, max_num_batched_tokens=64, dcp=world,
                                heads_per_rank=heads)
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(tensor_model_parallel_size=world, decode_context_model_parallel_size=world)
            group = get_dcp_group()
            dh._GROUP["dcp"] = group
            dh._install_standins(dict.fromkeys(["direct_q_gather", "direct_a2a", "nccl_a2a", "nccl_all_gather"], 0))
            pm._install_ag_rs_standin()  # the ag_rs Triton correction kernel, as torch
            layer = mla.MLAAttention.__new__(mla.MLAAttention)
            torch.nn.Module.__init__(layer)
            layer.layer_name = "model.layers.0.self_attn.attn"
            layer.qk_rope_head_dim = ROPE
            process_weights(layer, rank, heads, nope, lora, v, qrep=True, project=True)
            # the gathered weights, head by head, against every rank's own kv_b_proj
            w_uk = torch.cat([split_weights(r, heads, nope, lora, v)[0] for r in range(world)], dim=1)
            w_uv = torch.cat([split_weights(r, heads, nope, lora, v)[1] for r in range(world)], dim=1)
            qrep_w = layer.W_UK_T_dcp_qrep
            report["W_UK_T_dcp_qrep_err"] = float((qrep_w.double() - w_uk.permute(1, 2, 0)).abs().max())
            w_uv_dcp = compat.added(layer, "W_UV_dcp")
            report["W_UV_dcp_err"] = (float((w_uv_dcp.double() - w_uv.transpose(0, 1)).abs().max())
                                      if w_uv_dcp is not None else None)
            scale = 1 / math.sqrt(lora + ROPE)

            def manager(transport: str, head_dim: int):
                vc.parallel_config.dcp_comm_backend = "ag_rs" if transport == "ag_rs" else "a2a"
                os.environ["VLLM_USE_DIRECT_DCP_A2A"] = "1" if transport == "direct_a2a" else "0"
                dcp.get_direct_dcp_a2a_workspace.cache_clear()
                return dcp.MLADCPManager(
                    vllm_config=vc, device=torch.device("cpu"), num_heads=heads, query_head_dim=lora + ROPE,
                    output_head_dim=head_dim, query_dtype=torch.bfloat16, output_dtype=torch.bfloat16,
                    padded_num_heads=None, is_lse_base_on_e=True, use_pcp=False)

            for transport in ("ag_rs", "nccl_a2a", "direct_a2a"):
                latent_mgr, projected_mgr = manager(transport, lora), manager(transport, v)
                for batch in BATCHES:
                    row: dict[str, Any] = {"transport": transport, "batch": batch}
                    try:
                        q_rep = replicated_query(batch, world * heads, nope, ROPE)
                        kv, pe = kv_cache(batch, lora, ROPE)
                        # forward_impl's decode under query replication: absorb every group head with
                        # W_UK_T_dcp_qrep (bf16 bmm), no query all-gather, attend over this rank's shard
                        ql = torch.bmm(q_rep[..., :nope].transpose(0, 1), qrep_w).transpose(0, 1)
                        q_abs = torch.cat([ql, q_rep[..., nope:]], dim=-1)
                        out, lse = shard_attention(q_abs, batch, kv, pe, rank, world, scale)
                        out, lse = out.to(torch.bfloat16), lse.float()
                        query_lens, _ = BATCHES[batch]
                        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
                        seq_lens = torch.tensor(local_seq_lens(batch, rank, world), dtype=torch.int32)
                        ref = reference(batch, q_rep, kv, pe, rank, world, heads, nope, lora, v, scale)
                        row["ref_max"] = float(ref.abs().max())
                        # the release's order: merge in latent space, then project (ag_rs rescales
                        # the partials in place: a copy, as each forward hands the combine its own)
                        merged = latent_mgr.combine(out.clone(), lse.clone(), seq_lens=seq_lens,
                                                    query_start_loc=qsl)
                        base = torch.empty(out.shape[0], heads * v, dtype=torch.bfloat16)
                        layer._v_up_proj(merged, out=base)
                        row["baseline_err"] = float((base.double() - ref).abs().max())
                        # the patch: project every gathered head, then merge
                        layer.dcp_manager = projected_mgr
                        got = torch.full((out.shape[0], heads * v), float("nan"), dtype=torch.bfloat16)
                        with compat.exercising("MLADCPManager.project_combine under query replication"):
                            compat.added(projected_mgr, "project_combine")(
                                out, lse.clone(), compat.added(layer, "W_UV_dcp"), out=got,
                                seq_lens=seq_lens, query_start_loc=qsl)
                        row["projected_err"] = float((got.double() - ref).abs().max())
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {exc}"
                        row["error_kind"] = getattr(type(exc), "overlay_failure", "behaviour")
                    group.barrier()
                    report["checks"].append(row)
    except Exception as exc:
        report.update(fatal_report(exc))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))


def run_ranks(tmp: Path, dims: tuple[int, int, int, int] = (4, 16, 64, 32), world: int = 2,
              timeout: float = 600) -> list[dict[str, Any]]:
    """:func:`worker` on ``world`` gloo ranks (TP = DCP = ``world``; ``dims`` = heads per rank,
    qk_nope_head_dim, kv_lora_rank, v_head_dim); each rank's report."""
    return spawn_ranks(worker, lambda r, port: (r, world, port, str(tmp / "model"), str(tmp), list(sys.path), *dims),
                       tmp, world=world, timeout=timeout)
