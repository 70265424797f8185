"""``make bench-merge`` where the release's DCP manager owns ``v_up_proj_combine``: the per-rank sweep.

For each transport (ag_rs, NCCL a2a, the direct A2A) the release's own ``MLADCPManager`` is built by its
``__init__`` from a ``VllmConfig`` (``dcp_comm_backend`` and ``VLLM_USE_DIRECT_DCP_A2A`` pick the
transport, as in serving), with GLM-5's dimensions: ``kv_lora_rank`` 512, ``v_head_dim`` 256, 64 heads
over ``--tp`` (8 heads per rank at production's TP8). At every token count of the grid (1, 2, 4, ... up to
the release's DCP workspace size, then the next power of two: past it the direct A2A falls back) three
orders of the same partials run side by side, in alternating rounds:

- ``unprojected``: ``manager.combine`` merges the latent partials, then ``MLAAttention._v_up_proj``
  (the release's W_UV bmm) projects this rank's heads;
- ``projected``: ``manager.v_up_proj_combine`` with the DCP-gathered W_UV, its own policy (upstream's
  NCCL a2a merges first below its ``_V_UP_PROJ_FIRST_MIN_TOKENS``);
- ``first``: the same with that threshold at 0, so it projects first at every token count: the sweep
  that says where the threshold belongs. The threshold is the module constant ending in ``MIN_TOKENS``
  that the function behind ``v_up_proj_combine`` reads (read from the code, not named here); a hook
  without one is timed under its policy alone.

A transport whose manager has no ``v_up_proj_combine`` is reported as such (``projection: null``) with
its unprojected times; one the machine cannot run (the direct A2A without symmetric memory) as not
available, with the reason. Times: the slower rank's median per call, under CUDA-graph replay and
eagerly on GPUs; on CPU ranks (gloo, the test's dry run) eagerly with the host clock.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

GLM5 = {"heads": 64, "kv_lora_rank": 512, "v_head_dim": 256, "qk_rope_head_dim": 64}
TRANSPORTS = ("ag_rs", "nccl_a2a", "direct_a2a")
ORDERS = ("unprojected", "projected", "first")
MLA_ATTENTION = "vllm.model_executor.layers.attention.mla_attention"


@dataclass(frozen=True)
class SweepOptions:
    """What one sweep runs; every rank gets the same."""

    ops_module: str  # the release's DCP ops (``overlay.releases.derive.dcp_ops``)
    tp: int = 8  # GLM-5's 64 heads over this many ranks: heads per rank
    max_num_seqs: int | None = None  # None: the release's default (sizes the DCP workspace)
    tokens: tuple[int, ...] = ()  # () : the grid of the workspace size
    replays: int = 50
    rounds: int = 5
    inner: int = 10
    bounds: str = "decode"
    transports: tuple[str, ...] = field(default=TRANSPORTS)
    parallel: tuple[tuple[str, str], ...] = ()  # ParallelConfig fields set by name (e.g. a projection switch)

    @property
    def heads_per_rank(self) -> int:
        return GLM5["heads"] // self.tp


def token_grid(workspace: int) -> list[int]:
    """1, 2, 4, ... up to ``workspace`` (the release's DCP workspace size, itself included), then the next
    power of two: every threshold a transport has lies inside (the direct A2A's fallback past the
    workspace included)."""
    grid = [1 << i for i in range(int(math.log2(workspace)) + 1)]
    if grid[-1] != workspace:
        grid.append(workspace)
    grid.append(1 << (int(math.log2(workspace)) + 1))
    return grid


def bounds(n: int, world: int, rank: int, device: Any, kind: str) -> tuple[Any, Any]:
    """(seq_lens, query_start_loc) the layer hands the combine for a batch of ``n`` rows.

    ``decode``: what the engine passes for a decode batch: one query row per sequence, each
    sequence's local KV length on this rank (a few thousand tokens, none empty), as int32 tensors.
    ``none``: no bounds (the merge masks nothing; what the first benchmark runs measured).
    """
    import torch

    if kind == "none":
        return None, None
    seq_lens = (torch.arange(n, device=device, dtype=torch.int32) * 7 + 2048 + rank) // world
    return seq_lens, torch.arange(n + 1, device=device, dtype=torch.int32)


def vllm_config(world: int, device_type: str, max_num_seqs: int | None,
                parallel: tuple[tuple[str, str], ...] = ()) -> Any:
    """The release's ``VllmConfig`` for DCP = TP = ``world`` on ``device_type``, ``parallel``'s fields of
    ``ParallelConfig`` set (its validation converts them), the release's defaults otherwise."""
    from vllm.config import DeviceConfig, ParallelConfig, SchedulerConfig, VllmConfig

    kwargs: dict[str, Any] = {}
    if max_num_seqs is not None:
        kwargs["scheduler_config"] = SchedulerConfig.default_factory(max_num_seqs=max_num_seqs)
    pc = ParallelConfig(tensor_parallel_size=world, decode_context_parallel_size=world, **dict(parallel))
    return VllmConfig(parallel_config=pc, device_config=DeviceConfig(device=device_type), **kwargs)


@contextmanager
def dcp_group(rank: int, world: int, port: int, config: Any, backend: str) -> Iterator[Any]:
    """vLLM's own DCP group (DCP = TP = ``world``) under ``config``, over ``backend`` (nccl or gloo)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        get_dcp_group,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with set_current_vllm_config(config):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend=backend,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tensor_model_parallel_size=world, decode_context_model_parallel_size=world)
        yield get_dcp_group()


def _name(fn: Any) -> str | None:
    """The function behind ``fn`` (partials and bound methods unwrapped), by name; None for None."""
    if fn is None:
        return None
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(getattr(fn, "__func__", fn), "__name__", type(fn).__name__)


def threshold_knob(hook: Any) -> tuple[dict[str, Any], str] | None:
    """(the globals, the name) of the one int module constant ending in ``MIN_TOKENS`` that the function
    behind ``hook`` reads, or None where it reads none (or several: which one rules is not ours to guess)."""
    fn = hook
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    code, globs = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is None or globs is None:
        return None
    names = [n for n in code.co_names if n.endswith("MIN_TOKENS") and type(globs.get(n)) is int]
    return (globs, names[0]) if len(names) == 1 else None


@contextmanager
def _knob_at(knob: tuple[dict[str, Any], str] | None, value: int) -> Iterator[None]:
    if knob is None:
        yield
        return
    globs, name = knob
    old = globs[name]
    globs[name] = value
    try:
        yield
    finally:
        globs[name] = old


def build_manager(config: Any, transport: str, device: Any, opts: SweepOptions) -> Any:
    """The release's ``MLADCPManager`` as ``MLAAttention.__init__`` builds it, on ``transport``."""
    import importlib

    import torch

    ops = importlib.import_module(opts.ops_module)
    config.parallel_config.dcp_comm_backend = "ag_rs" if transport == "ag_rs" else "a2a"
    os.environ["VLLM_USE_DIRECT_DCP_A2A"] = "1" if transport == "direct_a2a" else "0"
    ops.get_direct_dcp_a2a_workspace.cache_clear()
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        return ops.MLADCPManager(
            vllm_config=config, device=device, num_heads=opts.heads_per_rank,
            query_head_dim=GLM5["kv_lora_rank"] + GLM5["qk_rope_head_dim"], output_head_dim=GLM5["kv_lora_rank"],
            query_dtype=torch.bfloat16, output_dtype=torch.bfloat16, padded_num_heads=None,
            is_lse_base_on_e=True, use_pcp=False)


class _Clock:
    """Per-call microseconds of a step: CUDA events on a GPU, the host clock on CPU ranks."""

    def __init__(self, device: Any) -> None:
        self.cuda = device.type == "cuda"

    def sample(self, step: Callable[[], None], inner: int) -> float:
        import torch

        if not self.cuda:
            t0 = time.perf_counter()
            step()
            return (time.perf_counter() - t0) * 1e6 / inner
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000.0 / inner


def stepper(fn: Callable[[], None], group: Any, graph: bool, inner: int) -> Callable[[], None]:
    """One sample's step: ``inner`` back-to-back calls of ``fn`` (one CUDA graph, or eager)."""
    import torch

    def calls() -> None:
        for _ in range(inner):
            fn()

    if not graph:
        return calls
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    group.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        calls()
    return g.replay


def time_side_by_side(fns: list[Callable[[], None]], group: Any, device: Any, graph: bool, *, replays: int,
                      rounds: int = 5, inner: int = 10) -> list[float]:
    """The slower rank's median microseconds per call of each of ``fns``.

    One sample is ``inner`` back-to-back calls after a barrier, divided by ``inner``: the ranks' launch
    skew at the barrier is spread over the calls instead of dominating a ~20 us decode-sized merge. The
    ``replays`` samples of each are taken in ``rounds`` alternating blocks (a, b, c, a, b, c, ...), so
    clock or neighbour drift during the run weighs on all alike.
    """
    import torch

    clock = _Clock(device)
    steps = [stepper(fn, group, graph, inner) for fn in fns]
    for step in steps:
        for _ in range(3):
            step()
    samples: list[list[float]] = [[] for _ in steps]
    per_round = -(-replays // rounds)
    for _ in range(rounds):
        for which, step in enumerate(steps):
            for _ in range(per_round):
                group.barrier()
                samples[which].append(clock.sample(step, inner))
    med = torch.tensor([statistics.median(s) for s in samples], device=device, dtype=torch.float64)
    torch.distributed.all_reduce(med, op=torch.distributed.ReduceOp.MAX, group=group.device_group)
    return [float(x) for x in med.tolist()]


def _orders(manager: Any, layer: Any, w_uv_dcp: Any, partial: Any, lse: Any, seq_lens: Any, qsl: Any,
            knob: tuple[dict[str, Any], str] | None) -> tuple[dict[str, Callable[[], None]], dict[str, Any]]:
    """The step of each order this manager has, and the output each writes (every order its own inputs:
    a combine may rescale its partials in place)."""
    import importlib

    import torch

    mla = importlib.import_module(MLA_ATTENTION).MLAAttention
    n = partial.shape[0]
    outs = {o: torch.empty(n, layer.num_heads * layer.v_head_dim, dtype=partial.dtype, device=partial.device)
            for o in ORDERS}
    inputs = {o: (partial.clone(), lse.clone()) for o in ORDERS}

    def unprojected() -> None:
        p, s = inputs["unprojected"]
        merged = manager.combine(p, s, seq_lens=seq_lens, query_start_loc=qsl)
        mla._v_up_proj(layer, merged, out=outs["unprojected"])

    def projected(order: str = "projected") -> None:
        p, s = inputs[order]
        manager.v_up_proj_combine(p, s, w_uv_dcp, outs[order], seq_lens=seq_lens, query_start_loc=qsl)

    def first() -> None:
        with _knob_at(knob, 0):
            projected("first")

    steps: dict[str, Callable[[], None]] = {"unprojected": unprojected}
    if manager.v_up_proj_combine is not None:
        steps["projected"] = projected
        if knob is not None:
            steps["first"] = first
    return steps, outs


def _row(at: SimpleNamespace, manager: Any, layer: Any, transport: str, n: int,
         knob: tuple[dict[str, Any], str] | None) -> dict[str, Any]:
    """One grid point of one transport: each order's output checked against ``unprojected``'s (the largest
    difference over the ranks, relative to the largest value), then timed."""
    import torch

    lora = layer.kv_lora_rank
    gen = torch.Generator(device=at.device).manual_seed(1000 * at.rank + n)
    partial = torch.randn(n, at.world * layer.num_heads, lora, generator=gen, device=at.device).bfloat16()
    lse = torch.randn(n, at.world * layer.num_heads, generator=gen, device=at.device) * 3
    seq_lens, qsl = bounds(n, at.world, at.rank, at.device, at.opts.bounds)
    steps, outs = _orders(manager, layer, at.w_uv_dcp, partial, lse, seq_lens, qsl, knob)
    row: dict[str, Any] = {"transport": transport, "tokens": n}
    try:
        for step in steps.values():
            step()
        ref = outs["unprojected"].float()
        compared = [o for o in steps if o != "unprojected"]
        diffs = torch.stack([(outs[o].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
                             for o in compared] or [ref.new_zeros(())]).double()
        torch.distributed.all_reduce(diffs, op=torch.distributed.ReduceOp.MAX, group=at.group.device_group)
        row.update({f"{o}_rel_diff": float(d) for o, d in zip(compared, diffs.tolist(), strict=False)})
        for mode in at.modes:
            times = time_side_by_side(list(steps.values()), at.group, at.device, mode == "graph",
                                      replays=at.opts.replays, rounds=at.opts.rounds, inner=at.opts.inner)
            for order, us in zip(steps, times, strict=True):
                row[f"{order}_{mode}_us"] = us
    except Exception as exc:  # one cell's failure is reported in its row; the sweep goes on
        row["error"] = f"{type(exc).__name__}: {exc}"
        if at.device.type == "cuda":
            torch.cuda.synchronize()
        at.group.barrier()
    return row


def sweep_rank(config: Any, group: Any, device: Any, opts: SweepOptions) -> dict[str, Any]:
    """Every transport's managers and rows on this rank (every rank returns the same structure)."""
    import importlib

    import torch

    ops = importlib.import_module(opts.ops_module)
    workspace = int(ops.get_dcp_workspace_max_num_tokens(config))
    tokens = list(opts.tokens) or token_grid(workspace)
    world, rank = group.world_size, group.rank_in_group
    heads, lora, v = opts.heads_per_rank, GLM5["kv_lora_rank"], GLM5["v_head_dim"]
    gen = torch.Generator(device=device).manual_seed(11 + rank)
    w_uv = (torch.randn(heads, lora, v, generator=gen, device=device) / lora**0.5).bfloat16()
    layer = SimpleNamespace(num_heads=heads, kv_lora_rank=lora, v_head_dim=v, W_UV=w_uv,
                            is_aiter_triton_fp4_bmm_enabled=False, is_aiter_triton_fp8_bmm_enabled=False,
                            is_amx_bmm_enabled=False)
    at = SimpleNamespace(rank=rank, world=world, device=device, group=group, opts=opts,
                         w_uv_dcp=group.all_gather(w_uv.contiguous(), dim=0),
                         modes=("graph", "eager") if device.type == "cuda" else ("eager",))
    result: dict[str, Any] = {
        "kind": "v_up_proj_combine", "world": world, "tp": opts.tp, "heads_per_rank": heads,
        "dims": dict(GLM5), "workspace_tokens": workspace, "max_num_seqs": config.scheduler_config.max_num_seqs,
        "tokens": tokens, "modes": list(at.modes), "options": asdict(opts), "transports": {}, "rows": [],
        "parallel_config": {name: getattr(config.parallel_config, name) for name, _ in opts.parallel},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (gloo: wiring only)",
    }
    for transport in opts.transports:
        about: dict[str, Any] = {"available": False}
        result["transports"][transport] = about
        try:
            manager = build_manager(config, transport, device, opts)
        except Exception as exc:  # e.g. no symmetric memory for the direct A2A
            about["why"] = f"the manager refused it: {type(exc).__name__}: {exc}"
            continue
        combine = _name(manager.combine)
        if transport == "direct_a2a" and combine != "_direct_workspace_combine":
            about["why"] = f"the manager took {combine} (no direct workspace here)"
            continue
        hook = manager.v_up_proj_combine
        knob = threshold_knob(hook) if hook is not None else None
        about.update(available=True, combine=combine, projection=_name(hook),
                     knob=None if knob is None else {"name": knob[1], "value": knob[0][knob[1]]})
        for n in tokens:
            result["rows"].append(_row(at, manager, layer, transport, n, knob))
            group.barrier()
    return result


def gpu_worker(rank: int, world: int, port: int, opts: SweepOptions, out_file: str) -> None:
    """One GPU rank of ``make bench-merge``: NCCL, the compiled kernels loaded; rank 0 writes the JSON."""
    import json

    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    import torch

    torch.cuda.set_device(rank)
    if not hasattr(torch.ops._C, "direct_dcp_a2a_lse_reduce"):
        import vllm

        try:
            torch.ops.load_library(str(Path(vllm.__file__).parent / "_C_stable_libtorch.abi3.so"))
        except OSError:
            pass  # no compiled kernels: the direct transport is reported unavailable
    config = vllm_config(world, "cuda", opts.max_num_seqs, opts.parallel)
    with dcp_group(rank, world, port, config, "nccl") as group:
        result = sweep_rank(config, group, torch.device("cuda", rank), opts)
    if rank == 0:
        result["env"] = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")}
        Path(out_file).write_text(json.dumps(result, indent=1))
