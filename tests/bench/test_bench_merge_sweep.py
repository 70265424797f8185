"""``make bench-merge`` on a release whose DCP manager owns ``v_up_proj_combine``: which bench a build takes
(read from its tree), the token grid and the thresholds read from a sweep, and a CPU dry run of the sweep on
two gloo ranks through the release's own ``MLADCPManager`` for every transport (GPU-only exchanges stood in
for at their call boundary), down to the printed grid, ``merge.md`` and ``merge.png``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from overlay.bench.merge_sweep import TRANSPORTS, token_grid
from overlay.bench.merge_sweep_report import finish, implied, thresholds
from overlay.releases import derive
from overlay.releases.source import FolderTree, importable_tree

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "patches")]
from ranks import spawn_ranks  # noqa: E402


class Tree:
    """A release tree of a few files, in memory."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files

    @property
    def where(self) -> str:
        return "memory"

    def read(self, path: str) -> str | None:
        return self.files.get(path)


def _ops(init_body: str) -> Tree:
    return Tree({"vllm/v1/attention/ops/dcp.py": "class MLADCPManager:\n    def __init__(self, group):\n"
                                                 f"        {init_body}\n"})


def test_a_build_takes_the_sweep_where_its_manager_owns_v_up_proj_combine() -> None:
    assert derive.manager_projects(_ops("self.v_up_proj_combine = None"))
    assert not derive.manager_projects(_ops("self.combine = None"))
    assert not derive.manager_projects(_ops("other.v_up_proj_combine = None"))
    with pytest.raises(derive.Missing, match="no class MLADCPManager"):
        derive.manager_projects(Tree({"vllm/v1/attention/ops/dcp.py": "X = 1\n"}))
    assert derive.manager_projects(FolderTree(importable_tree()))  # the installed build: the default release


def test_a_parallel_config_field_the_release_lacks_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    from overlay.cli import main

    assert "dcp_comm_backend" in derive.parallel_fields(FolderTree(importable_tree()))
    assert main(["bench-merge", "--parallel-config", "dcp_no_such_field=on", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("bench-merge: --parallel-config dcp_no_such_field: the installed vLLM's ParallelConfig "
                   "(vllm/config/parallel.py) has no such field")


def test_the_grid_brackets_every_threshold_up_to_past_the_workspace() -> None:
    assert token_grid(1) == [1, 2]
    assert token_grid(8) == [1, 2, 4, 8, 16]
    assert token_grid(768) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024]


def test_the_implied_threshold_is_where_projecting_first_stays_faster() -> None:
    assert implied([(1, 1.1), (2, 0.9), (4, 1.01), (8, 0.8), (16, 0.7)]) == 8
    assert implied([(1, 0.9), (2, 0.9)]) == 1
    assert implied([(1, 0.9), (2, 1.0)]) is None
    assert implied([]) is None


def test_a_cpu_dry_run_sweeps_every_transport_through_the_release_s_manager(tmp_path: Path, capsys) -> None:
    from merge_sweep_ranks import worker

    from overlay.cli import main

    parallel = (("dcp_kv_cache_interleave_size", "1"),)  # set by name, converted by the release's validation
    reports = spawn_ranks(worker, lambda r, port: (r, 2, port, str(tmp_path), list(sys.path), 8, parallel),
                          tmp_path, world=2, timeout=120)
    result = json.loads((tmp_path / "merge.json").read_text())
    assert result["parallel_config"] == {"dcp_kv_cache_interleave_size": 1}
    assert result["workspace_tokens"] == 8 and result["tokens"] == [1, 2, 4, 8, 16]
    assert result["heads_per_rank"] == 8 and result["modes"] == ["eager"]
    about = result["transports"]
    assert set(about) == set(TRANSPORTS) and all(a["available"] for a in about.values()), about
    assert {t: a["combine"] for t, a in about.items()} == {
        "ag_rs": "cp_lse_ag_out_rs", "nccl_a2a": "dcp_a2a_lse_reduce", "direct_a2a": "_direct_workspace_combine"}
    assert about["nccl_a2a"]["projection"] == "dcp_a2a_v_up_proj_lse_reduce"  # upstream's hook
    knob = about["nccl_a2a"]["knob"]
    assert knob["name"].endswith("MIN_TOKENS") and knob["value"] >= 1
    assert all(r["calls"]["direct_a2a"] > 0 for r in reports)  # the direct A2A op ran, not a fallback alone
    for r in (r for r in result["rows"] if r["transport"] == "nccl_a2a"):
        if r["tokens"] < knob["value"]:  # the hook merges first (the same ops as unprojected); "first" does not
            assert r["projected_rel_diff"] == 0.0 < r["first_rel_diff"], r
        else:  # the hook projects first itself: "first" runs the same code
            assert r["projected_rel_diff"] == r["first_rel_diff"] > 0.0, r
    for transport, a in about.items():
        rows = [r for r in result["rows"] if r["transport"] == transport]
        assert [r["tokens"] for r in rows] == result["tokens"] and not any("error" in r for r in rows), rows
        orders = ["unprojected"] + (["projected"] if a["projection"] else []) + (["first"] if a["knob"] else [])
        for r in rows:
            assert sorted(k for k in r if k.endswith("_eager_us")) == sorted(f"{o}_eager_us" for o in orders)
            assert all(r[f"{o}_eager_us"] > 0 for o in orders)
            assert all(r[f"{o}_rel_diff"] < 2e-2 for o in orders[1:]), r  # the same output, bf16 rounding apart
    said = thresholds(result)
    for transport, a in about.items():
        if a["projection"] is None:
            assert said[transport]["says"].startswith("no v_up_proj_combine"), said
        else:
            assert said[transport]["order"] == ("first" if a["knob"] else "projected")
    capsys.readouterr()
    assert finish(tmp_path / "merge.json")["thresholds"] == said  # what run() does with rank 0's JSON
    assert json.loads((tmp_path / "merge.json").read_text())["thresholds"] == said
    printed = capsys.readouterr().out
    for transport in TRANSPORTS:
        assert f"threshold {transport}: " in printed
        for n in result["tokens"]:
            assert any(line.split()[:2] == [transport, str(n)] for line in printed.splitlines()), (transport, n)
    md = (tmp_path / "merge.md").read_text()
    assert "![projected / unprojected against tokens](merge.png)" in md
    assert all(f"| {t} | " in md for t in TRANSPORTS)
    assert (tmp_path / "merge.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    redrawn = tmp_path / "redrawn"
    assert main(["bench-merge", "--plot", str(tmp_path / "merge.json"), "--out", str(redrawn)]) == 0
    assert (redrawn / "merge.md").read_text() == md
