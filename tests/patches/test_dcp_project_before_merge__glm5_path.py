"""dcp-project-before-merge judged on the code GLM-5 runs (``glm5_path``), with the series under it.

The attention class the release's own registry resolves for ``GlmMoeDsaForCausalLM`` on CUDA, built
by its real ``__init__`` on two gloo ranks (TP 2 x DCP 2) and on one (the DCP 1 reference), runs one
step of each case (decode, an MTP-5 verification step, a mixed batch, a forced-MQA prefill chunk,
rows a rank owns no selected token for) over each transport (ag_rs, NCCL a2a, the direct A2A with
its kernel's own argument checks), with ``VLLM_DCP_PROJECT_BEFORE_MERGE`` off, unset and on:

- every DCP 2 step equals DCP 1 (which equals attention computed in float64 from the same data), the
  step's top-k merged from each rank's local top-k by the release's own indexer merge
  (``_merge_dcp_topk_global``, its kernels from ``dcp_topk_standins``);
- with the switch on, the projection is what runs on that path: the combine carries ``v_head_dim``
  values, or the fused projected combine runs; off, the latent output is merged.

vLLM 0.28.0 runs ``MLAAttention.forward_impl`` for GLM-5 (``deepseek_v2``); from 0.29.0 on GLM-5
runs ``DeepseekV32Attention._sparse_indexer_and_attn``, where the 0.33.0 projection, sized for
``v_head_dim`` but never called, made the direct A2A kernel refuse every step ("combined output has
the wrong shape"). The rank pair runs once per module (about half a minute on two cores).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import compat
import glm5_path as g
import pytest
import torch

# bf16: the absorbed query, the partials, the merge and the projection each round once (~2^-8
# relative); a lost partial, a row merged with the wrong weight or a wrong head is of the order of
# the output itself.
REL_TOL = 3e-2
RUNS = g.runs_for(2)


def _ranks(tmp: Path, world: int) -> tuple[Path, list[dict[str, Any]]]:
    return tmp, g.run_ranks(tmp, world)


@pytest.fixture(scope="module")
def dcp1(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    return _ranks(tmp_path_factory.mktemp("glm5-dcp1"), 1)


@pytest.fixture(scope="module")
def dcp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    return _ranks(tmp_path_factory.mktemp("glm5-dcp2"), 2)


def _close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = float((out.double() - ref.double()).abs().max())
    top = float(ref.double().abs().max())
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    assert err <= REL_TOL * top, f"{what}: max error {err:.3g} against a reference of max {top:.3g}"


def test_the_registry_resolves_glm5_to_a_described_attention(dcp1, dcp2) -> None:
    paths = [rep["path"] for _, reps in (dcp1, dcp2) for rep in reps]
    assert all(p == paths[0] for p in paths), paths
    # the module the registry names, not a hand-picked class: what the release facts read in its tree
    # (0.28.0 maps GLM-5 to deepseek_v2's MLA wrapper, forward_impl; 0.29.0 on to DeepseekV32Attention)
    facts = g.release_path()
    assert paths[0] == {"model_class": facts.model_class, "entry": facts.entry,
                        "attention_class": f"{facts.attention_module}.{facts.attention_class}"}, paths[0]


@pytest.mark.parametrize("case", list(g.CASES))
def test_dcp1_is_attention(dcp1, case: str) -> None:
    """The check of the check: one rank over the whole cache computes attention (float64, same data)."""
    tmp, (rep,) = dcp1
    g.raise_for(rep["runs"][0]["cases"][case], 0)
    out = torch.load(g.output_file(tmp, 1, "none", "off", case, 0))
    _close(out, g.reference(case), f"DCP 1 {case}")


@pytest.mark.parametrize("case", list(g.CASES))
@pytest.mark.parametrize(("transport", "project"), RUNS, ids=[f"{t}-{p}" for t, p in RUNS])
def test_dcp2_step_equals_dcp1(dcp1, dcp2, transport: str, project: str, case: str) -> None:
    tmp2, reps = dcp2
    tmp1, _ = dcp1
    whole = torch.load(g.output_file(tmp1, 1, "none", "off", case, 0))
    width = whole.shape[1] // 2
    for rank, result in enumerate(g.case_results(reps, transport, project, case)):
        g.raise_for(result, rank)
        out = torch.load(g.output_file(tmp2, 2, transport, project, case, rank))
        _close(out, whole[:, rank * width:(rank + 1) * width], f"rank {rank} {transport} {case}")


def _projected(combines: list[dict[str, Any]]) -> bool:
    """The projection ran: the layer handed its partials to the manager's ``project_combine`` (which
    projects, or below its measured bound merges first), or every combine carried ``v_head_dim``."""
    return bool(combines) and (any(c["op"] == "project_combine" for c in combines)
                               or all(c["head_dim"] == g.V for c in combines))


@pytest.mark.parametrize("case", list(g.CASES))
@pytest.mark.parametrize("transport", g.TRANSPORTS)
def test_the_switch_projects_on_glm5s_path(dcp2, transport: str, case: str) -> None:
    """On, the merge GLM-5 runs is the projected one; off, the latent output is merged (the release's
    order). A release where the projection is in the tree but off GLM-5's path fails here with
    ``compat.OffModelPath`` (``make rebase``: off-model-path; the matrix: off the model's path)."""
    _, reps = dcp2
    offs, ons = g.case_results(reps, transport, "off", case), g.case_results(reps, transport, "on", case)
    for rank, (off, on) in enumerate(zip(offs, ons, strict=True)):
        g.raise_for(off, rank)
        assert off["combines"] and all(c["op"] == "combine" and c["head_dim"] == g.LORA for c in off["combines"]), off
        g.raise_for(on, rank)
        if not _projected(on["combines"]):
            message = (f"rank {rank}: with VLLM_DCP_PROJECT_BEFORE_MERGE=1 GLM-5's merge still carried kv_lora_rank "
                       f"({g.LORA}) values: {on['combines']}")
            if not reps[rank]["has_projection"]:  # the patch is not in this tree: its own bug, absent fix
                raise AssertionError(message)
            raise compat.OffModelPath(f"{message}; the projection is in the tree but not on the path "
                                      f"{reps[rank]['path']['attention_class']} runs")
    if transport == "direct_a2a":  # the direct kernel merged every step (its checks passed)
        assert all(r["direct_a2a_calls"] == 1 for r in g.case_results(reps, transport, "on", case))
