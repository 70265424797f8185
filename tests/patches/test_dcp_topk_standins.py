"""The DCP top-k merge's kernel stand-ins compute what the kernels compute and refuse what they refuse.

``dcp_topk_standins`` replaces only the compiled kernels of the release's ``_merge_dcp_topk_global``
(the pack, the exchange, the selectors); these tests hold each to the kernel's source: the selection
is the stable top-k (score key, then the smaller id), the pack maps a local index to its global
token id as the kernel does, each host check of the direct exchange's compiled selector fires on
its own fault; two gloo ranks through the release's own merge give every row's global top-k over
the all-gather and over the direct exchange (both ping-pong slots). On a CUDA machine (``-m gpu``)
the compiled selector of the installed release answers every case as the stand-in does.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import dcp_topk_standins as ts
import pytest
import torch
from packaging.version import Version
from ranks import spawn_ranks

V034 = Version("0.34.0")

# each case, the check that refuses it (every check of TOPK_CHECKS refuses one)
EXPECTED = {
    "accepted": "accepted",
    "candidates_not_whole_blocks": "candidates_multiple_of_block",
    "score_bits_zero": "score_bits_range",
    "id_bits_over_32": "id_bits_range",
    "fp16_inboxes": "inbox_dtype",
    "inboxes_of_other_capacity": "inbox_shape",
    "strided_inboxes": "inbox_strides",
    "misaligned_inboxes": "inbox_aligned",
    "int32_epoch": "epoch_dtype",
    "two_epochs": "epoch_shape",
    "int64_out": "out_dtype",
    "flat_out": "out_rank",
    "out_of_other_topk": "out_topk",
    "transposed_out": "out_inner_stride",
}


def _brute_force(scores: list[float], ids: list[int], topk: int, score_bits: int) -> list[int]:
    """The selection the kernels' source describes, by sorting: valid ids by (score key, smaller id)."""
    keys = ts.score_keys(torch.tensor(scores, dtype=torch.float32), score_bits).tolist()
    valid = sorted((i for i in range(len(ids)) if ids[i] >= 0), key=lambda i: (-keys[i], ids[i]))
    picked = [ids[i] for i in valid[:topk]]
    return picked + [-1] * (topk - len(picked))


@pytest.mark.parametrize("score_bits", [32, 16])
def test_the_selection_is_the_stable_topk(score_bits: int) -> None:
    gen = torch.Generator().manual_seed(score_bits)
    for trial in range(20):
        n = 64
        scores = (torch.randint(-8, 8, (n,), generator=gen).float() / 4).tolist()  # many ties
        if score_bits == 16:  # equal in their high 16 bits, different below: a tie to the bf16 key
            scores[1] = scores[0] + 1e-6 if scores[0] else scores[1]
        ids = torch.randperm(2 * n, generator=gen)[:n].tolist()
        for i in torch.randperm(n, generator=gen)[: trial % 9].tolist():
            ids[i] = -1
        topk = 8 + trial
        got = ts.select_rows(torch.tensor([scores]), torch.tensor([ids]), topk, score_bits, 32)[0].tolist()
        assert got == _brute_force(scores, ids, topk, score_bits)


def test_a_row_of_few_valid_candidates_keeps_them_all() -> None:
    """The ping-pong selector's short path: at most ``topk`` valid ids are kept whatever their scores."""
    scores = torch.tensor([[float("-inf"), 1.0, float("-inf"), 3.0]])
    ids = torch.tensor([[5, -1, 9, 2]])
    assert ts.pingpong_select(scores, ids, 4, 32, 32).tolist() == [[5, 9, 2, -1]]
    # more than topk valid: the best score, then of the two -inf the smaller id
    assert ts.pingpong_select(scores, ids, 2, 32, 32).tolist() == [[2, 5]]


@pytest.mark.parametrize(("world", "interleave"), [(2, 1), (4, 1), (2, 2)])
def test_the_pack_names_each_local_index_by_its_global_token(world: int, interleave: int) -> None:
    calls: dict[str, int] = {}
    rank, topk = world - 1, 4
    logits = torch.arange(40, dtype=torch.float32).view(2, 20)
    local = torch.tensor([[0, 3, -1, 5], [2, -1, -1, 1]], dtype=torch.int32)
    starts = torch.tensor([0, 10], dtype=torch.int32)
    packed = torch.zeros(2, topk, 2)
    ts.PackStandIn(calls)(logits, local, packed, starts, num_cols=20, dcp_rank=rank, dcp_world_size=world,
                          cp_interleave=interleave, has_row_starts=True, topk=topk)
    for r in range(2):
        for c in range(topk):
            idx = int(local[r, c])
            if idx < 0:
                assert packed[r, c].tolist() == [float("-inf"), -1.0]
                continue
            # the owner of global token t is (t // interleave) % world, at local (t // (world*I)) * I + t % I
            (t,) = [t for t in range(200) if (t // interleave) % world == rank
                    and (t // (world * interleave)) * interleave + t % interleave == idx]
            assert packed[r, c].tolist() == [float(logits[r, idx + int(starts[r])]), float(t)]
    with pytest.raises(RuntimeError, match="empty logits row"):
        ts.PackStandIn(calls)(logits[:, :0], local, packed, starts, num_cols=0, dcp_rank=0, dcp_world_size=world,
                              cp_interleave=1, has_row_starts=False, topk=topk)


@pytest.mark.parametrize("case", list(ts.PINGPONG_CASES))
def test_each_check_of_the_direct_selector_fires(case: str) -> None:
    assert ts.stand_in_pingpong_answer(V034, case) == EXPECTED[case]


def test_every_check_has_a_case() -> None:
    assert set(EXPECTED) == set(ts.PINGPONG_CASES)
    assert set(EXPECTED.values()) - {"accepted"} == set(ts.TOPK_CHECKS)


def test_the_merge_refuses_what_the_release_refuses() -> None:
    """The release's own support check, shown CPU logits as CUDA ones, keeps its dtype and ``index_topk``
    checks (128, the harness's old top-k, is refused: hence GLM-5's 512 there); the gathered selector's
    compile assertions refuse a top-k of part of a 512-thread slice."""
    indexer = importlib.import_module(ts.INDEXER)
    check = getattr(indexer, "_release_assert_cutedsl_dcp_merge_supported", indexer._assert_cutedsl_dcp_merge_supported)
    logits, idx = torch.zeros(2, 8), torch.zeros(2, 512, dtype=torch.int32)
    check(ts._AsOnCuda(logits), idx, 512)
    with pytest.raises(RuntimeError, match="index_topk in"):
        check(ts._AsOnCuda(logits), idx, 128)
    with pytest.raises(RuntimeError, match="fp32 logits"):
        check(ts._AsOnCuda(logits.half()), idx, 512)
    with pytest.raises(RuntimeError, match="CUDA tensors"):  # the one check the shim exists for
        check(logits, idx, 512)
    selector = ts.GatheredSelectorStandIn({})
    with pytest.raises(ts.KernelRefusal, match="multiple of tb_size"):
        selector(torch.zeros(4, 1, 128, 2), torch.zeros(1, 128, dtype=torch.int32), topk=128)  # 512 candidates


def test_two_ranks_merge_every_rows_global_topk(tmp_path: Path) -> None:
    """The release's ``_merge_dcp_topk_global`` on two gloo ranks, its kernels stood in: every row's
    global top-k on both ranks, over the all-gather and (0.34.0) twice over the direct exchange."""
    import sys

    reports = spawn_ranks(ts.merge_worker,
                          lambda r, port: (r, 2, port, str(tmp_path / "model"), str(tmp_path), list(sys.path)),
                          tmp_path, world=2, timeout=300)
    for rep in reports:
        assert rep["merges"], rep
        for name, merge in rep["merges"].items():
            want = ts.merge_expected(merge["seed"])
            got = [{i for i in row if i >= 0} for row in merge["ids"]]
            assert got == want, (rep["rank"], name)
            assert all(row.count(-1) == ts.TOPK - len(w) for row, w in zip(merge["ids"], want, strict=True))
            if name.startswith("direct"):
                assert merge["kernels"] == {"topk_pack": 1, "topk_push": 1, "topk_select_pingpong": 1}, merge
            else:
                assert merge["kernels"] == {"topk_pack": 1, "topk_select_gathered": 1}, merge


@pytest.mark.gpu
def test_the_compiled_selector_refuses_what_the_stand_in_refuses(tmp_path: Path) -> None:
    """On one GPU: the installed release's compiled ping-pong selector refuses exactly the cases the
    stand-in refuses (the words are the compiler's, recorded in ``$OVERLAY_RECORD_OUT``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import compat

    version = compat.vllm_version()
    real = ts.real_pingpong_answers()
    record = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "release": str(version),
              "cases": {case: {"real": real[case], "stand_in": ts.stand_in_pingpong_answer(version, case)}
                        for case in ts.PINGPONG_CASES}}
    out = os.environ.get("OVERLAY_RECORD_OUT")
    if out:
        Path(out).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    mismatches = {case: row for case, row in record["cases"].items()
                  if row["real"]["refused"] != (row["stand_in"] != "accepted")}
    assert not mismatches, mismatches
