"""One CPU rank of ``make bench-merge``'s sweep (the dry run of ``test_bench_merge_sweep``): vLLM's DCP group
over gloo, the GPU-only exchanges replaced at their call boundary by the GLM-5 path harness's stand-ins (the
direct A2A op's refuses what the compiled op refuses), then the bench's own :func:`sweep_rank`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def worker(rank: int, world: int, port: int, out_dir: str, sys_path: list[str], max_num_seqs: int,
           parallel: tuple[tuple[str, str], ...]) -> None:
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    from ranks import fatal_report

    report: dict[str, Any] = {"rank": rank}
    try:
        import glm5_path
        import torch

        from overlay.bench import merge_sweep
        from overlay.releases import derive
        from overlay.releases.source import FolderTree, importable_tree

        ops = derive.dcp_ops(FolderTree(importable_tree()))
        config = merge_sweep.vllm_config(world, "cpu", max_num_seqs, parallel)
        with merge_sweep.dcp_group(rank, world, port, config, "gloo") as group:
            calls: dict[str, int] = {}
            glm5_path.install_transports(group, calls)
            opts = merge_sweep.SweepOptions(ops, replays=2, rounds=1, inner=1, parallel=parallel)
            result = merge_sweep.sweep_rank(config, group, torch.device("cpu"), opts)
        report["calls"] = calls
        if rank == 0:
            Path(out_dir, "merge.json").write_text(json.dumps(result, indent=1))
    except Exception as exc:
        report.update(fatal_report(exc))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
