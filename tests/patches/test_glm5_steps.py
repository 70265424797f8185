"""Every step GLM-5 takes under DCP, on the code it runs (``glm5_path``): DCP 2 and DCP 4 against DCP 1.

The projection's tests (0.34.0: ``test_dcp_*_v_up_proj_*.py``; 0.28.0:
``test_dcp_project_before_merge__glm5_path.py``) run the decode, MTP-5, mixed and forced-MQA steps it changes
(``glm5_path.CASES``); this file runs the rest of what a GLM-5 server hands its attention
(``glm5_path.STEPS``), on the build under test as a whole (the release and its whole series), over every
transport (ag_rs, NCCL a2a, the direct A2A) with the projection switch off and on (``auto`` is one of
the two on each transport):

- a single request's one-token decode, and requests shorter than the DCP group (ranks that own no KV);
- CUDA-graph padding both ways: rows past the step's tokens outside the metadata (piecewise graphs) and a
  FULL decode graph's padded requests of ``1 + k`` rows inside it (Model Runner V2's uniform batch);
- LSEs as long contexts make them (a common score offset of about 543: ``exp`` of it overflows float32),
  through the decode merge and through the dense prefill's context merge;
- the dense-MHA prefill of short prompts (0.28.0 on): without context, over cached context (under DCP the
  context is gathered from every rank's shard, ``kv_gather``), exactly at ``index_topk`` and one past it
  (where the release sends the step to the sparse MQA path instead), and mixed with MTP-5 decodes.

Every rank's rows of the real tokens equal DCP 1's (which equals attention computed in float64), and every
step took the path its shape sends it on, as the release's own metadata builder routed it. Each rank set runs
once per module; DCP 4 (four gloo ranks, minutes on two cores) is marked ``long`` and runs in ``make
test-long``. This file runs here on the installed release; ``tests/test_patches_against_base.py`` runs it on
every other carried release's patched tree in that release's environment (0.28.0, production's: its dense
prefill through ``glm5_prefill_standins``' FlashAttention and merge stand-ins).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import compat
import glm5_path as g
import pytest
import torch

# bf16 rounding of the absorbed query, the partials, the merges and the projection (~2^-8 relative each);
# a lost partial, a row merged with the wrong weight or written to the wrong place is of the order of the
# output itself.
REL_TOL = 3e-2
NAMES = list(g.STEPS)
# DCP 4 is four gloo ranks on the CI's two cores (minutes): it runs with the long tests (`make test-long`)
WORLDS = (2, pytest.param(4, marks=pytest.mark.long))


# The switch's two settings per transport: ``auto`` is one of them on each (``on`` over NCCL a2a, ``off`` over
# ag_rs and the direct A2A), which the projection pieces' own tests hold it to.
RUNS = [(t, v) for t in g.TRANSPORTS for v in ("off", "on")]


def _ranks(factory: pytest.TempPathFactory, world: int) -> tuple[Path, list[dict[str, Any]]]:
    tmp = factory.mktemp(f"glm5-steps-dcp{world}")
    return tmp, g.run_ranks(tmp, world, NAMES, timeout=900, runs=RUNS if world > 1 else None)


@pytest.fixture(scope="module")
def dcp1(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    return _ranks(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def dcp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    return _ranks(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def dcp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    return _ranks(tmp_path_factory, 4)


def _close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert torch.isfinite(out).all(), f"{what}: non-finite output in the real rows"
    err = float((out.double() - ref.double()).abs().max())
    top = float(ref.double().abs().max())
    assert err <= REL_TOL * top, f"{what}: max error {err:.3g} against a reference of max {top:.3g}"


def _runs(world: int) -> list[tuple[str, str]]:
    return RUNS if world > 1 else g.runs_for(world)


@pytest.mark.parametrize("case", NAMES)
def test_dcp1_step_is_attention(dcp1, case: str) -> None:
    """The check of the check: one rank over the whole cache computes attention (float64, same data)."""
    tmp, (rep,) = dcp1
    g.raise_for(rep["runs"][0]["cases"][case], 0)
    out = torch.load(g.output_file(tmp, 1, "none", "off", case, 0))
    _close(out, g.reference(case), f"DCP 1 {case}")


@pytest.mark.parametrize("case", NAMES)
@pytest.mark.parametrize("world", WORLDS)
def test_dcp_step_equals_dcp1(dcp1, request: pytest.FixtureRequest, world: int, case: str) -> None:
    """Every transport and switch value at DCP ``world``: each rank's heads of the real rows equal DCP 1's."""
    tmp1, _ = dcp1
    tmp, reps = request.getfixturevalue(f"dcp{world}")
    whole = torch.load(g.output_file(tmp1, 1, "none", "off", case, 0))
    width = whole.shape[1] // world
    failures = []
    for transport, project in _runs(world):
        for rank, result in enumerate(g.case_results(reps, transport, project, case)):
            what = f"DCP {world} {transport} projection {project} rank {rank} {case}"
            try:
                g.raise_for(result, rank)
                out = torch.load(g.output_file(tmp, world, transport, project, case, rank))
                _close(out, whole[:, rank * width:(rank + 1) * width], what)
            except (AssertionError, compat.BehaviourFailure) as exc:
                line = (str(exc).splitlines() or [""])[0]  # _close's messages already name the run
                failures.append(line if line.startswith(what) else f"{what}: {line}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", NAMES)
@pytest.mark.parametrize("world", WORLDS)
def test_each_step_takes_its_path(dcp1, request: pytest.FixtureRequest, world: int, case: str) -> None:
    """The shape decides the path, as the release routes it: a prefill whose longest sequence is at most
    ``index_topk`` runs dense MHA (over DCP its cached context is gathered from every rank), one token past it
    the sparse MQA path; decodes always run sparse MQA and, under DCP, a merge. The release's metadata builder
    chose that route (``prefill.use_dense_mha``; no prefill metadata for a step of decodes)."""
    spec = g.case_of(case)
    has_context = any(s > q for q, s in zip(spec.query_lens, spec.seq_lens, strict=True) if q > g.DECODE_THRESHOLD)
    # a step of decodes builds no prefill metadata, or (0.28.0, whose builder splits a batch of unequal short
    # queries at the first longer one) prefill metadata routed to sparse MQA
    routes = (spec.dense,) if spec.prefill_max_seq_len else (None, False)
    for size, (_, reps) in ((1, dcp1), (world, request.getfixturevalue(f"dcp{world}"))):
        for transport, project in _runs(size):
            for rank, result in enumerate(g.case_results(reps, transport, project, case)):
                g.raise_for(result, rank)
                steps, where = result["steps"], f"DCP {size} {transport} {project} rank {rank}"
                assert result["dense_route"] in routes, (where, result["dense_route"])
                assert steps.get("dense_mha", 0) == int(spec.dense), (where, steps)
                assert steps.get("mqa", 0) == int(spec.merges), (where, steps)
                gathered = size > 1 and spec.dense and has_context
                assert steps.get("kv_gather", 0) == int(gathered), (where, steps)
                if size > 1:
                    assert bool(result["combines"]) == spec.merges, (where, result["combines"])


def test_the_routing_threshold_is_index_topk(dcp1) -> None:
    """The two threshold cases sit on either side of the release's own routing: its metadata builder routed
    the prefill at ``index_topk`` to dense MHA and the one a token past it to sparse MQA (every release), and
    its routing function, where it has one (0.34.0's ``_use_dense_mha_prefill``), says the same."""
    _, (rep,) = dcp1
    at, past = g.case_of("dense_at_topk"), g.case_of("mqa_past_topk")
    assert at.prefill_max_seq_len == g.TOPK and past.prefill_max_seq_len == g.TOPK + 1
    run = rep["runs"][0]["cases"]
    assert (run["dense_at_topk"]["dense_route"], run["mqa_past_topk"]["dense_route"]) == (True, False), (
        run["dense_at_topk"]["dense_route"], run["mqa_past_topk"]["dense_route"])
    assert at.dense and not past.dense
    try:
        sparse = importlib.import_module("vllm.model_executor.layers.attention.sparse_mla_attention")
    except ImportError:
        sparse = None
    route = getattr(sparse, "_use_dense_mha_prefill", None)
    if route is None:  # 0.28.0: the builder's own expression, read above
        return

    class _Attention:
        hisparse_config = None
        sparse_mla_force_mqa = False

    class _Config:
        attention_config = _Attention()

    assert route(_Config(), at.prefill_max_seq_len, g.TOPK)
    assert not route(_Config(), past.prefill_max_seq_len, g.TOPK)


def test_each_dcp2_step_merges_the_ranks_topk_as_the_release_does(dcp1, dcp2) -> None:
    """The indexer's DCP top-k merge is the release's own (``_merge_dcp_topk_global``) on every rank, each
    step: one pack and one exchange per merge (a decode and a prefill merge where the step has both),
    the exchange the release's call site picks (the direct one for at most ``direct_max_rows`` rows:
    GLM-5's ``_sparse_indexer_and_attn`` passes none on 0.34.0, so the all-gather); DCP 1 merges nothing."""
    _, reps = dcp2
    if reps[0]["path"]["entry"] != "sparse_indexer_and_attn":
        pytest.skip("GLM-5 runs MLAAttention.forward_impl here (0.28.0): its indexer is not in the section")
    for rank, rep in enumerate(reps):
        merges = rep["indexer"]["merges"]
        for case in NAMES:
            groups = g.indexer_row_groups(g.make_step(case))
            mine = [m for m in merges if m["case"] == case]
            assert [m["rows"] for m in mine] == [r.stop - r.start for r in groups] * len(RUNS), (
                rank, case, mine)
            for m in mine:
                direct = 0 < m["rows"] <= m["direct_max_rows"]
                assert m["exchange"] == ("direct" if direct else "all_gather"), (rank, case, m)
                assert m["kernels"].get("topk_pack") == 1, (rank, case, m)
    _, (rep1,) = dcp1
    assert {m["exchange"] for m in rep1["indexer"]["merges"]} == {"none"}
