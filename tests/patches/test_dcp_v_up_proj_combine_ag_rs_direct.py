"""dcp-v-up-proj-combine-ag-rs-direct: with ``dcp_v_up_proj_before_merge="on"`` the ag_rs and direct A2A
managers register a ``v_up_proj_combine`` of their own, as the NCCL a2a manager does.

- GLM-5's attention class from the release's registry on two gloo ranks against one (``glm5_path``),
  over ag_rs and the direct A2A (its kernel's own argument checks): ``on`` gathers ``W_UV_dcp`` and
  merges through the transport's ``v_up_proj_combine`` (the direct kernel once, on v_head_dim-wide
  partials); ``auto`` and ``off`` keep the latent merge; every step equals DCP 1;
- the ag_rs manager registers the JIT warm-up of its output-correction kernel for every head dim its
  branches run: ``v_head_dim`` (projected) and ``kv_lora_rank`` (the merge-first branch below two
  tokens), so neither compiles at the first decode step.
"""

from __future__ import annotations

from types import SimpleNamespace

import compat
import glm5_path as g
import glm5_projection as gp
import pytest
import sparse_dcp_harness as h
import torch

VALUES = ["off", "auto", "on"]
TRANSPORTS = ["ag_rs", "direct_a2a"]
RUNS = [(t, v) for t in TRANSPORTS for v in VALUES]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> gp.Ranks:
    return gp.run_both(tmp_path_factory, RUNS)


@pytest.mark.parametrize("case", list(g.CASES))
@pytest.mark.parametrize(("transport", "value"), RUNS, ids=[f"{t}-{v}" for t, v in RUNS])
def test_step_equals_dcp1(ranks, transport: str, value: str, case: str) -> None:
    gp.assert_equals_dcp1(ranks, transport, value, case)


@pytest.mark.parametrize("case", list(g.CASES))
@pytest.mark.parametrize(("transport", "value"), RUNS, ids=[f"{t}-{v}" for t, v in RUNS])
def test_on_merges_projected_outputs_on_every_transport(ranks, transport: str, value: str, case: str) -> None:
    reps = ranks.reports
    gathered = [r["W_UV_dcp"] for r in gp.build(reps, transport, value)]
    results = gp.result(reps, transport, value, case)
    if value != "on":
        assert gathered == [None, None], f"{value} must not gather W_UV over ag_rs or the direct A2A"
        assert gp.merges(results) == [{("combine", g.LORA)}] * 2
        return
    assert gathered == [[g.HEADS, g.LORA, g.V]] * 2
    assert gp.merges(results) == [{("v_up_proj_combine", g.LORA)}] * 2
    if transport == "direct_a2a":  # the kernel merged the step once, sized for v_head_dim (its checks passed)
        assert [r["direct_a2a_calls"] for r in results] == [1, 1]


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory):
    return h.make_vllm_config(tmp_path_factory.mktemp("glm5"), comm_backend="ag_rs")


@pytest.mark.parametrize(("value", "head_dims"), [("on", [g.V, g.LORA]), ("auto", [g.LORA]), ("off", [g.LORA])])
def test_ag_rs_warms_up_every_head_dim_it_merges(monkeypatch: pytest.MonkeyPatch, vllm_config, value: str,
                                                 head_dims: list[int]) -> None:
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    dcp = compat.module("dcp")
    group = SimpleNamespace(world_size=2, rank_in_group=0, device_group=None)
    monkeypatch.setattr(dcp, "get_dcp_group", lambda: group)
    monkeypatch.setattr(dcp, "get_direct_dcp_q_gather_workspace", lambda *args: None)
    monkeypatch.setattr(vllm_config.parallel_config, "dcp_v_up_proj_before_merge", value, raising=False)
    registry = JitWarmupRegistry(vllm_config)
    with registry.activate(), compat.exercising("MLADCPManager.__init__ (ag_rs)"):
        manager = dcp.MLADCPManager(
            vllm_config=vllm_config, device=torch.device("cpu"), num_heads=h.NUM_HEADS,
            query_head_dim=g.LORA + g.ROPE, output_head_dim=g.LORA, query_dtype=torch.bfloat16,
            output_dtype=torch.bfloat16, padded_num_heads=None, is_lse_base_on_e=False, use_pcp=False,
            v_head_dim=g.V)
    registered = registry._registrations.get(dcp._CORRECT_ATTN_CP_OUT_KERNEL, [])
    assert sorted(kwargs["head_dim"] for _, kwargs in registered) == sorted(head_dims)
    assert (manager.v_up_proj_combine is not None) == (value == "on")
