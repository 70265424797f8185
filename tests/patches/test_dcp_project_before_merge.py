"""dcp-project-before-merge: project through the DCP-gathered W_UV, then merge (issue 9).

With DCP each rank holds partial latent outputs ``[T, dcp * heads, kv_lora_rank]``; 0.28.0
merges them by LSE and then projects by ``W_UV``. The patch projects every gathered head first
(``W_UV`` all-gathered over the DCP group at weight processing, like ``W_UK_T``;
``MLADCPManager.project_combine``: one bmm, then the manager's own combine) so the merge moves
``v_head_dim`` per head. Checked here:

- two real ranks (gloo), real ``process_weights_after_loading``, real ``project_combine`` and
  combines of every transport (ag_rs, NCCL a2a, direct a2a; GPU-only kernels replaced at their
  boundary on CPU): project-then-merge equals the float64 reference (merge, then project) up
  to bf16 rounding, for one token (ag_rs merges first there), decode, MTP, mixed, forced-MQA
  prefill and empty sparse rows (zero with LSE -inf, as the backend leaves them);
- the real ``forward_impl`` takes the projected merge when DCP > 1 and the switch is on, and
  is untouched (latent merge, then ``_v_up_proj``) when the switch is off or DCP = 1;
- the same check on four gloo ranks (tiny dimensions): the harness runs for any rank count;
- the GPU version of the first check on ``OVERLAY_DCP_RANKS`` H200s (default 2; ``gpu``
  marker), GLM-5 and DeepSeek-V3.2 dimensions (8 heads per rank, TP = DCP = ranks), vLLM's
  compiled direct kernel and Triton combines, with the fused kernels off (the default) and on
  (dcp-project-before-merge-fused), eager and captured in a CUDA graph.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import compat
import dcp_project_merge_harness as pm
import pytest
import sparse_dcp_harness as h
import torch
from ranks import gpu_ranks

TRANSPORTS = ["ag_rs", "nccl_a2a", "direct_a2a"]
# bf16 output: merge-then-project and project-then-merge each round a few times (partials,
# projection, merged output), ~2^-8 relative each; a wrong head, weight, or a leaked empty row
# gives errors of the order of the output itself (or NaN). That is for two ranks: the merge
# adds one bf16 term per rank (ag_rs reduce-scatters bf16 partials), so the rounding grows
# with the rank count; four ranks measure up to ~1e-2 on CPU. The bound scales by ranks / 2.
REL_TOL = 8e-3


def _check(reports: list[dict[str, Any]], transport: str, batch: str, fused: bool = False) -> None:
    tol = REL_TOL * max(1.0, len(reports) / 2)  # one report per rank
    for rep in reports:
        (row,) = [r for r in rep["checks"] if r["transport"] == transport and r["batch"] == batch
                  and r.get("fused", False) == fused]
        assert "error" not in row, row["error"]
        assert row["projected_err"] <= tol * row["ref_max"], row
        if rep.get("device") == "cuda":  # also captured in a CUDA graph, as decode runs
            assert row["projected_graph_err"] <= tol * row["ref_max"], row
        assert row["baseline_err"] <= tol * row["ref_max"], row  # the reference itself holds


@pytest.fixture(scope="module")
def cpu_reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return pm.run_ranks(tmp_path_factory.mktemp("p9cpu"), "cpu", dims=(4, 16, 64, 32))


@pytest.mark.parametrize("batch", [b[0] for b in pm.BATCHES])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_projected_merge_matches_float64_reference(cpu_reports, transport: str, batch: str) -> None:
    _check(cpu_reports, transport, batch)


def test_four_ranks_projected_merge_matches_reference(tmp_path: Path) -> None:
    """Four gloo ranks (TP = DCP = 4, 2 heads each): every transport and batch, as with two."""
    reports = pm.run_ranks(tmp_path, "cpu", dims=(2, 16, 64, 32), world=4)
    assert [rep["W_UV_dcp_shape"] for rep in reports] == [[8, 64, 32]] * 4  # 4 ranks * 2 heads
    for transport in TRANSPORTS:
        for batch, *_ in pm.BATCHES:
            _check(reports, transport, batch)


def test_gathered_w_uv_and_the_managers_own_combines(cpu_reports) -> None:
    """W_UV gathered over the DCP group; the projected merge runs the manager's own combine of each
    transport (the direct one through its over-capacity fallback), no fused kernel by default, and
    ag_rs alone merges first below its measured bound."""
    for rep in cpu_reports:
        assert rep["W_UV_dcp_shape"] == [8, 64, 32]  # dcp * heads, kv_lora_rank, v_head_dim
        names = {(tuple(r["combine"]), r["project_first_min_tokens"]) for r in rep["checks"]}
        # ((latent combine, projected combine, fused project-and-merge), merge-first bound)
        assert names == {(("cp_lse_ag_out_rs", "cp_lse_ag_out_rs", None), 2),
                         (("dcp_a2a_lse_reduce", "dcp_a2a_lse_reduce", None), 0),
                         ((compat.name("combine_direct_a2a"), compat.name("combine_direct_a2a"), None), 0)}


@pytest.mark.parametrize(("env", "dcp", "pcp", "expected"), [
    (None, 2, False, "default"), ("1", 4, False, True), ("0", 2, False, False),
    (None, 1, False, False), ("1", 2, True, False),
])
def test_switch_decides(monkeypatch: pytest.MonkeyPatch, env: str | None, dcp: int, pcp: bool,
                        expected: bool | str) -> None:
    """Unset, the switch takes the default this tree's ``envs.py`` gives it: the one the series sets for
    this release (what an engine run proved of it: ``make status``, from ``tests/test_proven.py``'s records)."""
    if env is None:
        monkeypatch.delenv("VLLM_DCP_PROJECT_BEFORE_MERGE", raising=False)
    else:
        monkeypatch.setenv("VLLM_DCP_PROJECT_BEFORE_MERGE", env)
    if expected == "default":
        variables = importlib.import_module("vllm.envs").environment_variables
        assert "VLLM_DCP_PROJECT_BEFORE_MERGE" in variables, "no VLLM_DCP_PROJECT_BEFORE_MERGE in envs.py"
        expected = bool(variables["VLLM_DCP_PROJECT_BEFORE_MERGE"]())
    mla = compat.module("mla_attention")
    assert compat.added(mla.MLAAttention, "use_dcp_project_before_merge")(dcp, pcp) is expected


# --------------------------------------------------------------------------------------------
# The real forward_impl (sparse_dcp_harness layer: rank 0 of DCP = 2, the peer simulated)
# --------------------------------------------------------------------------------------------
FORWARD_BATCHES = {
    "decode": ("flashinfer_mla_sparse", "FlashInferMLASparseMetadata", [1, 1, 1], [90, 5, 40], 1),
    "mtp": ("flashinfer_mla_sparse", "FlashInferMLASparseMetadata", [3, 3], [70, 130], 3),
}


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory):
    return h.make_vllm_config(tmp_path_factory.mktemp("glm5"))


def _forward(vllm_config, name: str, batch: str, project: bool):
    module, cls_name, query_lens, seq_lens, threshold = FORWARD_BATCHES[batch]
    rec = h.Recorder()
    layer = h.make_layer(vllm_config, name, rec)
    gen = torch.Generator().manual_seed(5)
    peer_w_uv = torch.randn((layer.impl.dcp_world_size - 1) * h.NUM_HEADS, h.LORA, h.V, generator=gen)
    latent_combine = layer.dcp_manager.combine
    seen: dict[str, Any] = {}

    def combine(partial_output, partial_lse, *, seq_lens, query_start_loc):
        seen["dim"] = partial_output.shape[-1]
        if partial_output.shape[-1] == h.LORA:
            return latent_combine(partial_output, partial_lse, seq_lens=seq_lens,
                                  query_start_loc=query_start_loc)
        # Projected: the peers project their partials through the same gathered W_UV.
        a2a = compat.module("dcp_alltoall")
        lse = partial_lse.clone()
        compat.module("ops_common").mask_dcp_empty_shards_(lse, seq_lens, query_start_loc)
        peers = [torch.einsum("bhl,hlv->bhv", p.double(), layer.W_UV_dcp.double()) for p in rec.peer_outs]
        merged = a2a._lse_weighted_combine(torch.stack([partial_output.double(), *peers]),
                                           torch.stack([lse, *rec.peer_lses]).double(),
                                           is_lse_base_on_e=False)
        return merged[:, :h.NUM_HEADS].to(partial_output.dtype)

    layer.dcp_manager.combine = combine
    if project:  # what __init__ / process_weights_after_loading set up with the switch on
        layer.dcp_project_before_merge = True
        layer.W_UV_dcp = torch.cat([layer.W_UV, peer_w_uv])
    md = h.build_metadata(vllm_config, name, compat.symbol(module, cls_name), query_lens, seq_lens,
                          threshold)
    out, produced = h.run_forward(layer, md, sum(query_lens))
    expected = h.expected_rows(layer, rec, produced["out"], produced["lse"])
    return out, expected, seen, layer


@pytest.mark.parametrize("batch", list(FORWARD_BATCHES))
def test_forward_projects_before_merge_when_on(vllm_config, batch: str) -> None:
    out, expected, seen, _ = _forward(vllm_config, f"layers.p9on.{batch}.attn", batch, project=True)
    assert seen["dim"] == h.V, "the merge must carry v_head_dim (projected) values"
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch", list(FORWARD_BATCHES))
def test_forward_untouched_when_switch_off(vllm_config, batch: str) -> None:
    out, expected, seen, layer = _forward(vllm_config, f"layers.p9off.{batch}.attn", batch,
                                          project=False)
    assert not compat.added(layer, "dcp_project_before_merge")  # the class default: off unless __init__ enables
    assert seen["dim"] == h.LORA
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_dcp1_process_weights_gathers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP = 1 (switch on): no gathered W_UV, no DCP collective at weight processing."""
    mla = compat.module("mla_attention")
    monkeypatch.setattr(mla, "get_dcp_group", lambda: pytest.fail("DCP group used with DCP = 1"))
    flag = compat.added(mla.MLAAttention, "use_dcp_project_before_merge")(1, False)
    layer = pm.make_layer(4, 16, 64, 32, 0, torch.device("cpu"), project=flag)
    assert compat.added(layer, "W_UV_dcp") is None and not layer.dcp_project_before_merge
    assert tuple(layer.W_UV.shape) == (4, 64, 32)


# --------------------------------------------------------------------------------------------
# GPU: OVERLAY_DCP_RANKS ranks (default 2), NCCL, vLLM's compiled direct A2A kernel and Triton
# combines; 8 heads per rank (GLM-5's 64 heads at TP8), world * 8 in all
# --------------------------------------------------------------------------------------------
GPU_DIMS = {"glm5": (8, 192, 512, 256), "deepseek_v32": (8, 128, 512, 128)}


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(GPU_DIMS))
def test_gpu_projected_merge_exact_every_transport(tmp_path: Path, model: str) -> None:
    world = gpu_ranks()
    reports = pm.run_ranks(tmp_path, "cuda", dims=GPU_DIMS[model], world=world, timeout=400)
    out_dir = Path(__import__("os").environ.get("P9_REPORT_DIR", tmp_path))
    suffix = "" if world == 2 else f"_dcp{world}"  # two ranks: the report name the bench reads
    (out_dir / f"p9_gpu_{model}{suffix}.json").write_text(__import__("json").dumps(reports, indent=1))
    for transport in TRANSPORTS:
        for fused in (False, True):
            for batch, *_ in pm.BATCHES:
                _check(reports, transport, batch, fused)
