"""``make bench-merge``: DCP merge + W_UV projection, merge-then-project vs project-then-merge.

Which bench runs is read from the installed build's tree: where the release's ``MLADCPManager`` owns
``v_up_proj_combine`` (0.29.0 on), the sweep of :mod:`overlay.bench.merge_sweep` (its report:
:mod:`overlay.bench.merge_sweep_report`); where it has none and the series adds ``project_combine``
(0.28.0's), the bench below, which drives that patch's API.

``--ranks`` ranks, 2 by default (one process per GPU, NCCL, vLLM's own DCP group with
DCP = TP = ranks, 8 heads per rank as GLM-5's 64 heads at TP8). For each model's
dimensions, token count and transport, both orders run through the patched vLLM's own code:

- baseline (vLLM 0.28.0's order): the transport merges the latent partials
  ``[T, 2 * heads, kv_lora_rank]``, then ``MLAAttention._v_up_proj`` projects this rank's heads;
- optimized (dcp-project-before-merge): ``MLADCPManager.project_combine`` projects every
  gathered head through the DCP-gathered ``W_UV`` with one batched matmul and the transport's
  own combine merges ``[T, 2 * heads, v_head_dim]`` (ag_rs merges first below its measured
  bound); with ``VLLM_DCP_PROJECT_FUSED=1`` in the environment (dcp-project-before-merge-fused)
  the transport's fused Triton function takes it where it applies (``project_reduce_scatter``,
  ``project_all_to_all``, ``project_direct``): the projection lands in the layout the transport
  sends and the merge writes this rank's heads into the output. ``merge.json`` says which.

Transports: ``ag_rs`` (``cp_lse_ag_out_rs``), ``nccl_a2a`` (``dcp_a2a_lse_reduce``) and
``direct_a2a`` (vLLM's symmetric-memory kernel, when it loads). Each is timed under CUDA-graph
replay (median of ``--replays`` replays after warm-up, each replay fenced by a barrier and
holding 10 back-to-back merges, reported per merge; the slower rank's median counts) and
eagerly the same way. Both orders get the sequence bounds the layer hands the combine
(``--bounds decode``: one query row per sequence and each sequence's local KV length, int32, as
in a decode step; ``none``: no bounds, nothing to mask). ``--profile-eager T ...`` adds, at those
token counts, torch.profiler tables of 20 eager calls of each order (``profile/*.txt``: where
the host time goes) and their host microseconds per call (``*_host_us`` in the JSON).
Payload: the bytes of the partial outputs handed to the merge, per rank. Outputs ``merge.json``, a
text table (``merge.txt``) and ``merge.png`` (matplotlib, Agg; with ``--plot JSON`` the plot is
drawn from an earlier run's JSON, e.g. on a machine without matplotlib next to the GPUs).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from overlay.bench.merge_sweep import bounds as sequence_bounds
from overlay.bench.merge_sweep import time_side_by_side

MODELS: dict[str, dict[str, int]] = {
    "GLM-5": {"heads": 8, "kv_lora_rank": 512, "v_head_dim": 256},
    "DeepSeek-V3.2": {"heads": 8, "kv_lora_rank": 512, "v_head_dim": 128},
}
TOKENS = [1, 16, 128, 768, 8192]
TRANSPORTS = ["ag_rs", "nccl_a2a", "direct_a2a"]


def fused_from_env() -> bool:
    """Whether the optimized order takes dcp-project-before-merge-fused's kernels (vLLM's switch)."""
    return os.environ.get("VLLM_DCP_PROJECT_FUSED", "0") == "1"


def _transport_fns(transport: str, group: Any, device: Any, heads: int, kv_lora_rank: int, v_head_dim: int,
                   max_tokens: int) -> tuple[Any, Any] | None:
    """(vLLM's combine of ``kv_lora_rank``-wide partials, the patch's ``project_combine`` over the
    same transport sized for ``v_head_dim``), or None where the transport is unavailable. The
    manager is vLLM's own class with the state its ``__init__`` gives each transport."""
    import functools

    import torch
    from vllm.v1.attention.ops import dcp_utils
    from vllm.v1.attention.ops.common import cp_lse_ag_out_rs
    from vllm.v1.attention.ops.dcp_alltoall import dcp_a2a_lse_reduce

    project_fns = {}
    if fused_from_env():
        from vllm.v1.attention.ops import dcp_project

        project_fns = {"ag_rs": dcp_project.project_reduce_scatter, "nccl_a2a": dcp_project.project_all_to_all}
    manager = dcp_utils.MLADCPManager.__new__(dcp_utils.MLADCPManager)
    manager.group, manager.fused_project_combine = group, None
    manager.project_first_min_tokens = dcp_utils._AG_RS_PROJECT_FIRST_MIN_TOKENS if transport == "ag_rs" else 0
    if transport in ("ag_rs", "nccl_a2a"):
        combine = functools.partial(cp_lse_ag_out_rs if transport == "ag_rs" else dcp_a2a_lse_reduce,
                                    cp_group=group, is_lse_base_on_e=True)
        manager.combine = combine
        if transport in project_fns:
            manager.fused_project_combine = functools.partial(project_fns[transport], cp_group=group,
                                                              is_lse_base_on_e=True)
        return combine, manager.project_combine
    os.environ["VLLM_USE_DIRECT_DCP_A2A"] = "1"
    latent_ws, projected_ws = (
        dcp_utils.get_direct_dcp_a2a_workspace(group, device, max_tokens, heads, dim, torch.bfloat16, 1)
        for dim in (kv_lora_rank, v_head_dim))
    if latent_ws is None or projected_ws is None:
        return None
    manager.combine = functools.partial(manager._combine_direct_a2a, projected_ws, is_lse_base_on_e=True)
    if fused_from_env():
        manager.fused_project_combine = functools.partial(manager._fused_project_direct, projected_ws,
                                                          is_lse_base_on_e=True)
    return (functools.partial(manager._combine_direct_a2a, latent_ws, is_lse_base_on_e=True),
            manager.project_combine)


def _time_pair(base: Any, opt: Any, replays: int, group: Any, graph: bool, rounds: int = 5,
               inner: int = 10) -> tuple[float, float]:
    """Median microseconds per call of ``base`` and ``opt``, the slower rank's each (sampled as
    :func:`overlay.bench.merge_sweep.time_side_by_side` says)."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    b, o = time_side_by_side([base, opt], group, device, graph, replays=replays, rounds=rounds, inner=inner)
    return b, o


def _steps(layer: Any, base_combine: Any, partial: Any, lse: Any, seq_lens: Any = None,
           query_start_loc: Any = None) -> tuple[Any, Any, Any, Any]:
    """(baseline step, optimized step, baseline output, optimized output) for one batch."""
    import torch
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    out_base = torch.empty(partial.shape[0], layer.num_heads * layer.v_head_dim,
                           dtype=torch.bfloat16, device=partial.device)
    out_opt = torch.empty_like(out_base)
    lse_b, lse_o = lse.clone(), lse.clone()
    # Each order gets its own partials: 0.28.0's ag_rs correction rescales its input in place.
    partial_b = partial.clone()

    def baseline() -> None:  # vLLM 0.28.0's order: merge the latent partials, then project
        merged = base_combine(partial_b, lse_b, seq_lens=seq_lens, query_start_loc=query_start_loc)
        MLAAttention._v_up_proj(layer, merged, out=out_base)

    def optimized() -> None:  # the patch: project every gathered head, then merge
        layer.project_combine(partial, lse_o, layer.W_UV_dcp, out=out_opt, seq_lens=seq_lens,
                              query_start_loc=query_start_loc)

    return baseline, optimized, out_base, out_opt


def _profile_eager(base: Any, opt: Any, group: Any, path: Path, rank: int, calls: int = 20) -> dict[str, float]:
    """Host time of ``calls`` eager calls of each order under torch.profiler; rank 0 writes the tables.

    Every rank runs the calls (they are collectives). Returns the host microseconds per call of
    each order (wall time of the calls on the host, the GPU drained before and after).
    """
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    host: dict[str, float] = {}
    tables = []
    for name, fn in (("baseline", base), ("optimized", opt)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        group.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            host[name] = (time.perf_counter() - t0) * 1e6 / calls
            torch.cuda.synchronize()
        group.barrier()
        tables.append(f"== {name}: {host[name]:.1f} us of host time per call ({calls} calls) ==\n"
                      + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(tables) + "\n")
    return host


@contextmanager
def _dcp_group(rank: int, world: int, port: int) -> Iterator[tuple[Any, Any]]:
    """This rank's device and vLLM's own DCP group (DCP = TP = ``world``), the kernels loaded."""
    import torch

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        get_dcp_group,
        init_distributed_environment,
        initialize_model_parallel,
    )

    if not hasattr(torch.ops._C, "direct_dcp_a2a_lse_reduce"):
        import vllm

        try:
            torch.ops.load_library(str(Path(vllm.__file__).parent / "_C_stable_libtorch.abi3.so"))
        except OSError:
            pass  # no compiled kernels: the direct transport is reported unavailable
    vc = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=world,
                                                   decode_context_parallel_size=world),
                    device_config=DeviceConfig(device="cuda"))
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="nccl",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tensor_model_parallel_size=world,
                                  decode_context_model_parallel_size=world)
        yield device, get_dcp_group()


@dataclass(frozen=True)
class _Rank:
    """What every measurement of one rank shares."""

    rank: int
    world: int
    device: Any
    group: Any
    replays: int
    bounds: str
    profile_tokens: tuple[int, ...]
    profile_dir: Path


def _worker(rank: int, world: int, port: int, tokens: list[int], replays: int, out_file: str,
            bounds: str = "decode", profile_tokens: tuple[int, ...] = ()) -> None:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    import torch

    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    with _dcp_group(rank, world, port) as (device, group):
        at = _Rank(rank, world, device, group, replays, bounds, profile_tokens, Path(out_file).parent / "profile")
        for model, dims in MODELS.items():
            heads, lora, v = dims["heads"], dims["kv_lora_rank"], dims["v_head_dim"]
            gen = torch.Generator(device=device).manual_seed(11 + rank)
            w_uv = torch.randn(heads, lora, v, generator=gen, device=device).bfloat16() / lora**0.5
            w_uv_dcp = group.all_gather(w_uv.contiguous(), dim=0)
            for transport in TRANSPORTS:
                try:
                    fns = _transport_fns(transport, group, device, heads, lora, v, max(tokens))
                except Exception as exc:  # e.g. symmetric memory unavailable
                    fns = None
                    notes.append(f"{model} {transport}: {type(exc).__name__}: {exc}")
                if fns is None:
                    notes.append(f"{model} {transport}: not available here")
                    continue
                base_combine, project_combine = fns
                # the layer's state _v_up_proj reads, and the manager's project_combine forward_impl calls
                layer = SimpleNamespace(
                    num_heads=heads, kv_lora_rank=lora, v_head_dim=v, W_UV=w_uv, W_UV_dcp=w_uv_dcp,
                    is_aiter_triton_fp4_bmm_enabled=False, is_aiter_triton_fp8_bmm_enabled=False,
                    project_combine=project_combine)
                for n in tokens:
                    rows.append(_measure(at, layer, base_combine, model, transport, n, notes))
                    group.barrier()
    if rank == 0:
        Path(out_file).write_text(json.dumps({
            "world": world, "replays": replays, "models": MODELS, "tokens": tokens, "bounds": bounds, "rows": rows,
            "fused": fused_from_env(),
            "notes": notes, "gpu": torch.cuda.get_device_name(0),
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
        }, indent=1))


def _measure(at: _Rank, layer: Any, base_combine: Any, model: str, transport: str, n: int,
             notes: list[str]) -> dict[str, Any]:
    """One row: both orders at ``n`` tokens, checked against each other, timed eager and under graphs."""
    import torch

    heads, lora, v = layer.num_heads, layer.kv_lora_rank, layer.v_head_dim
    g2 = torch.Generator(device=at.device).manual_seed(1000 * at.rank + n)
    partial = torch.randn(n, at.world * heads, lora, generator=g2, device=at.device).bfloat16()
    lse = torch.randn(n, at.world * heads, generator=g2, device=at.device) * 3
    seq_lens, query_start_loc = sequence_bounds(n, at.world, at.rank, at.device, at.bounds)
    baseline, optimized, out_base, out_opt = _steps(layer, base_combine, partial, lse, seq_lens, query_start_loc)
    row: dict[str, Any] = {
        "model": model, "transport": transport, "tokens": n,
        "payload_baseline_bytes": n * at.world * heads * lora * 2,
        "payload_optimized_bytes": n * at.world * heads * v * 2,
    }
    try:
        baseline()
        optimized()
        torch.cuda.synchronize()
        ref = out_base.float()
        row["max_abs_diff"] = float((out_opt.float() - ref).abs().max())
        row["ref_max"] = float(ref.abs().max())
        for mode in ("eager", "graph"):
            try:
                (row[f"baseline_{mode}_us"],
                 row[f"optimized_{mode}_us"]) = _time_pair(baseline, optimized, at.replays, at.group, mode == "graph")
                row[f"speedup_{mode}"] = row[f"baseline_{mode}_us"] / row[f"optimized_{mode}_us"]
            except Exception as exc:
                row[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"
                notes.append(f"{model} {transport} T={n} {mode}: {traceback.format_exc(limit=4)}")
                torch.cuda.synchronize()
                at.group.barrier()
        if n in at.profile_tokens:
            try:
                host = _profile_eager(baseline, optimized, at.group,
                                      at.profile_dir / f"{model}-{transport}-T{n}.txt", at.rank)
                row["baseline_host_us"], row["optimized_host_us"] = host["baseline"], host["optimized"]
            except Exception as exc:
                notes.append(f"{model} {transport} T={n} profile: {type(exc).__name__}: {exc}")
                torch.cuda.synchronize()
                at.group.barrier()
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        notes.append(f"{model} {transport} T={n}: {traceback.format_exc(limit=3)}")
    return row


def table(result: dict[str, Any]) -> str:
    """The text table of a run."""
    head = (f"{'model':<14}{'transport':<12}{'T':>6}{'payload B->O (KiB)':>22}{'ratio':>7}"
            f"{'graph base us':>15}{'graph opt us':>14}{'x':>7}{'eager base':>12}{'eager opt':>11}{'x':>7}"
            f"{'|opt-base|/max':>16}")
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        pay = f"{r['payload_baseline_bytes'] / 1024:.0f} -> {r['payload_optimized_bytes'] / 1024:.0f}"
        ratio = r["payload_baseline_bytes"] / r["payload_optimized_bytes"]
        if "error" in r:
            lines.append(f"{r['model']:<14}{r['transport']:<12}{r['tokens']:>6}{pay:>22}{ratio:>7.2f}  "
                         f"error: {r['error'][:60]}")
            continue

        def cell(key: str, width: int, fmt: str = ".1f", r: dict[str, Any] = r) -> str:
            return f"{r[key]:>{width}{fmt}}" if key in r else f"{'-':>{width}}"

        lines.append(
            f"{r['model']:<14}{r['transport']:<12}{r['tokens']:>6}{pay:>22}{ratio:>7.2f}"
            f"{cell('baseline_graph_us', 15)}{cell('optimized_graph_us', 14)}{cell('speedup_graph', 7, '.2f')}"
            f"{cell('baseline_eager_us', 12)}{cell('optimized_eager_us', 11)}{cell('speedup_eager', 7, '.2f')}"
            f"{r.get('max_abs_diff', float('nan')) / max(r.get('ref_max', 1.0), 1e-30):>16.1e}")
    lines += [f"note: {n.strip()}" for n in result.get("notes", [])]
    return "\n".join(lines)


def plot(result: dict[str, Any], png: Path) -> None:
    """Latency under CUDA graphs against T, per model and transport (log-log), to ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for i, transport in enumerate(TRANSPORTS):
            rows = [r for r in result["rows"] if r["model"] == model and r["transport"] == transport
                    and "baseline_graph_us" in r]
            if not rows:
                continue
            t = [r["tokens"] for r in rows]
            color = f"C{i}"
            ax.plot(t, [r["baseline_graph_us"] for r in rows], "--o", color=color,
                    label=f"{transport}: merge, then project")
            ax.plot(t, [r["optimized_graph_us"] for r in rows], "-s", color=color,
                    label=f"{transport}: project, then merge")
        dims = result["models"][model]
        ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="latency (us, CUDA graph median)",
               title=f"{model}: kv_lora_rank {dims['kv_lora_rank']} -> v_head_dim {dims['v_head_dim']}, "
                     f"{dims['heads']} heads/rank")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"DCP merge + W_UV projection, {result['world']} ranks ({result.get('gpu', '')})")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out_dir: Path) -> None:
    """``merge.txt`` and ``merge.png`` next to ``merge.json`` (the plot needs matplotlib)."""
    text = table(result)
    (out_dir / "merge.txt").write_text(text + "\n")
    print(text)
    try:
        plot(result, out_dir / "merge.png")
        print(f"plot: {out_dir / 'merge.png'}")
    except ImportError:
        print("matplotlib missing here: draw the plot later with --plot merge.json")


def run(out_dir: Path, *, tokens: list[int] | None = None, replays: int = 50,
        plot_from: Path | None = None, ranks: int = 2, bounds: str = "decode",
        profile_tokens: tuple[int, ...] = (), release: str | None = None, tp: int = 8,
        max_num_seqs: int | None = None, parallel: tuple[tuple[str, str], ...] = ()) -> int:
    """Time the merges on ``ranks`` GPUs with the installed build (which must be ``release``'s), or only
    draw an earlier run's outputs (``plot_from``). A release whose DCP manager owns ``v_up_proj_combine``
    runs the sweep (:mod:`overlay.bench.merge_sweep`); one without it, ``project_combine``'s bench here."""
    out_dir.mkdir(parents=True, exist_ok=True)
    replays = max(replays, 50)  # the median of at least 50 replays
    if plot_from is not None:
        result = json.loads(plot_from.read_text())
        if result.get("kind") == "v_up_proj_combine":
            from overlay.bench.merge_sweep_report import write_outputs as write_sweep

            write_sweep(result, out_dir)
        else:
            write_outputs(result, out_dir)
        return 0
    from overlay.build.install import installed_mismatch

    why = installed_mismatch(release)
    if why is not None:
        print(f"bench-merge: {why}", file=sys.stderr)
        return 2
    from overlay.releases.derive import PARALLEL_CONFIG, Missing

    try:
        ops_module, sweep, fields = _installed_merges()
    except Missing as exc:
        print(f"bench-merge: the installed vLLM: {exc}", file=sys.stderr)
        return 2
    if sweep and profile_tokens:
        print("bench-merge: --profile-eager: only for a build whose manager has project_combine, not "
              f"{ops_module}'s v_up_proj_combine", file=sys.stderr)
        return 2
    unknown = next((name for name, _ in parallel if name not in fields), None)
    if unknown is not None:
        print(f"bench-merge: --parallel-config {unknown}: the installed vLLM's ParallelConfig "
              f"({PARALLEL_CONFIG}) has no such field", file=sys.stderr)
        return 2
    if parallel and not sweep:
        print("bench-merge: --parallel-config: only for a build whose manager owns v_up_proj_combine",
              file=sys.stderr)
        return 2
    import torch
    import torch.multiprocessing as mp

    if ranks < 2 or ranks & (ranks - 1):
        print(f"bench-merge: --ranks {ranks}: want a power of two >= 2 (DCP 2, 4 or 8)", file=sys.stderr)
        return 2
    if torch.cuda.device_count() < ranks:
        print(f"bench-merge: --ranks {ranks} needs {ranks} CUDA GPUs, found {torch.cuda.device_count()}"
              " (e.g. the nvidia-h200-x2 device for 2)", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    json_path = out_dir / "merge.json"
    if sweep:
        from overlay.bench.merge_sweep import SweepOptions, gpu_worker
        from overlay.bench.merge_sweep_report import finish

        opts = SweepOptions(ops_module, tp=tp, max_num_seqs=max_num_seqs, tokens=tuple(tokens or ()),
                            replays=replays, bounds=bounds, parallel=tuple(parallel))
        mp.spawn(gpu_worker, args=(ranks, port, opts, str(json_path)), nprocs=ranks)
        finish(json_path)
        return 0
    mp.spawn(_worker, args=(ranks, port, tokens or TOKENS, replays, str(json_path), bounds, tuple(profile_tokens)),
             nprocs=ranks)
    write_outputs(json.loads(json_path.read_text()), out_dir)
    return 0


def _installed_merges() -> tuple[str, bool, set[str]]:
    """(the importable build's DCP ops module, whether its manager owns ``v_up_proj_combine``, its
    ``ParallelConfig``'s fields), read from its tree without importing it."""
    from overlay.releases import derive
    from overlay.releases.source import FolderTree, importable_tree

    root = importable_tree()
    if root is None:
        raise derive.Missing("no importable vllm")
    tree = FolderTree(root)
    return derive.dcp_ops(tree), derive.manager_projects(tree), derive.parallel_fields(tree)
