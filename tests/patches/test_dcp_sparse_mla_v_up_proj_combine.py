"""dcp-sparse-mla-v-up-proj-combine: DeepseekV32Attention's sparse path merges W_UV-projected outputs
wherever ``W_UV_dcp`` is gathered (NCCL a2a), as ``MLAAttention.forward_impl`` does.

GLM-5's attention class from the release's registry on two gloo ranks against one
(``glm5_path``), with each transport's default policy: over NCCL a2a the step's merge is
``MLADCPManager.v_up_proj_combine`` (which projects, or below 8 tokens merges first), and the output
equals DCP 1; ag_rs and the direct A2A gather no ``W_UV_dcp`` and merge the latent output as before.
"""

from __future__ import annotations

import glm5_path as g
import glm5_projection as gp
import pytest

RUNS = [(t, "auto") for t in g.TRANSPORTS]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> gp.Ranks:
    return gp.run_both(tmp_path_factory, RUNS)


@pytest.mark.parametrize("case", list(g.CASES))
@pytest.mark.parametrize("transport", g.TRANSPORTS)
def test_sparse_dcp_step_equals_dcp1(ranks, transport: str, case: str) -> None:
    gp.assert_equals_dcp1(ranks, transport, "auto", case)


@pytest.mark.parametrize("case", list(g.CASES))
def test_sparse_path_merges_projected_outputs_over_nccl_a2a(ranks, case: str) -> None:
    reps = ranks.reports
    assert [r["W_UV_dcp"] for r in gp.build(reps, "nccl_a2a", "auto")] == [[g.HEADS, g.LORA, g.V]] * 2
    for merged in gp.merges(gp.result(reps, "nccl_a2a", "auto", case)):
        assert merged == {("v_up_proj_combine", g.LORA)}, merged


@pytest.mark.parametrize("case", list(g.CASES))
@pytest.mark.parametrize("transport", ["ag_rs", "direct_a2a"])
def test_other_transports_gather_nothing_and_merge_the_latent_output(ranks, transport: str, case: str) -> None:
    reps = ranks.reports
    assert [r["W_UV_dcp"] for r in gp.build(reps, transport, "auto")] == [None, None]
    for merged in gp.merges(gp.result(reps, transport, "auto", case)):
        assert merged == {("combine", g.LORA)}, merged
