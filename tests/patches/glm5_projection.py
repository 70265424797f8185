"""The W_UV projection before the DCP merge, judged on GLM-5's path: the checks 0.34.0's projection patches share.

Each patch's test runs :func:`glm5_path.run_ranks` at DCP 1 (the reference) and DCP 2 for the
(transport, ``dcp_v_up_proj_before_merge`` value) builds it judges (:func:`run_both`, in a module-scoped
fixture), then asks per case: did the step
equal DCP 1 (:func:`assert_equals_dcp1`), and which merge ran (:func:`merges`: the manager op called and
the head dim of the partials handed to it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import compat
import glm5_path as g
import pytest
import torch

# bf16: the absorbed query, the partials, the merge and the projection each round once (~2^-8 relative);
# a lost partial, a row merged with the wrong weight or a wrong head is of the order of the output itself.
REL_TOL = 3e-2


class Ranks(NamedTuple):
    """The reports of one DCP 1 run (the reference) and one DCP 2 run, each with its output folder."""

    dcp1: tuple[Path, list[dict[str, Any]]]
    dcp2: tuple[Path, list[dict[str, Any]]]

    @property
    def reports(self) -> list[dict[str, Any]]:
        """The DCP 2 ranks' reports."""
        return self.dcp2[1]


def run_both(tmp_path_factory: pytest.TempPathFactory, runs: list[tuple[str, str]]) -> Ranks:
    """Every case of :data:`glm5_path.CASES` on one rank and, for ``runs``, on two."""
    one, two = tmp_path_factory.mktemp("glm5-dcp1"), tmp_path_factory.mktemp("glm5-dcp2")
    return Ranks((one, g.run_ranks(one, 1)), (two, g.run_ranks(two, 2, runs=runs)))


def build(reports: list[dict[str, Any]], transport: str, value: str) -> list[dict[str, Any]]:
    """Each rank's record of the build of (``transport``, ``value``)."""
    out = []
    for rep in reports:
        if "runs" not in rep or rep.get("error"):
            raise compat.HarnessError(f"rank {rep.get('rank')}: {rep.get('error')}")
        (found,) = [r for r in rep["runs"] if r["transport"] == transport and r["project"] == value]
        out.append(found)
    return out


def result(reports: list[dict[str, Any]], transport: str, value: str, case: str) -> list[dict[str, Any]]:
    """Each rank's result of ``case`` in that build, raised as the failure it was where it failed."""
    out = [record["cases"][case] for record in build(reports, transport, value)]
    for rank, res in enumerate(out):
        g.raise_for(res, rank)
    return out


def merges(results: list[dict[str, Any]]) -> list[set[tuple[str, int]]]:
    """Per rank, the (manager op, partials' head dim) of each merge the step ran."""
    return [{(c["op"], c["head_dim"]) for c in r["combines"] if not c["op"].startswith("layer.")} for r in results]


def layer_merges(results: list[dict[str, Any]]) -> list[int]:
    """Per rank, how many times the step handed its partials to the layer's ``_dcp_combine_v_up_proj``."""
    return [sum(c["op"] == "layer._dcp_combine_v_up_proj" for c in r["combines"]) for r in results]


def assert_equals_dcp1(ranks: Ranks, transport: str, value: str, case: str) -> None:
    """Each DCP 2 rank's output of ``case`` equals its heads of the DCP 1 output."""
    (tmp1, reps1), (tmp2, reps2) = ranks
    result(reps1, "none", "off", case)
    whole = torch.load(g.output_file(tmp1, 1, "none", "off", case, 0))
    width = whole.shape[1] // 2
    for rank, _ in enumerate(result(reps2, transport, value, case)):
        out = torch.load(g.output_file(tmp2, 2, transport, value, case, rank))
        ref = whole[:, rank * width:(rank + 1) * width]
        err = float((out.double() - ref.double()).abs().max())
        top = float(ref.double().abs().max())
        assert torch.isfinite(out).all(), f"rank {rank} {transport} {value} {case}: non-finite output"
        assert err <= REL_TOL * top, (f"rank {rank} {transport} {value} {case}: max error {err:.3g} against "
                                      f"DCP 1 of max {top:.3g}")
