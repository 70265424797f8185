"""The DCP indexer's top-k merge on gloo ranks: the release's own Python, its compiled kernels stood in.

``sparse_attn_indexer._merge_dcp_topk_global`` (0.28.0+) turns each DCP rank's local top-k (positions
into its KV shard, with the logits they were chosen from) into the step's global top-k: a Triton
kernel packs each rank's ``(score, global token id)`` candidates, the ranks exchange them (an NCCL
all-gather; 0.34.0 also over symmetric memory, ``dcp_topk_direct``, for batches of at most
``direct_max_rows`` rows), and a CuteDSL kernel selects each row's top-k by score, the smaller id first
on a tie. Everything in that chain but the compiled kernels runs as the release has it; replaced, at
their call boundary only:

- ``_PACK_DCP_TOPK_CANDIDATES_KERNEL`` (Triton): :class:`PackStandIn`, what the kernel computes from
  the same launch arguments (an index past the row's logits reads the last column, as the kernel's
  clamp does; one into an empty logits row is refused: the kernel would read out of bounds);
- ``_STABLE_TOPK_FROM_GATHERED_CANDIDATES_KERNEL`` (CuteDSL): :class:`GatheredSelectorStandIn`, with
  its compile key's assertions (candidates and top-k in whole 512-thread slices, key bits in range);
- the direct exchange (0.34.0): ``_push_candidates_kernel`` and ``_publish_and_wait_kernel`` (Triton)
  over gloo, and the compiled ping-pong selector (``StableTopKFromPingPongCandidatesKernel.compile``),
  held to the host checks the compiled function makes (:data:`TOPK_CHECKS`, :func:`check_pingpong`);
- ``_assert_cutedsl_dcp_merge_supported``: the release's own, shown the logits as CUDA tensors (its
  device check is the one check a CPU run cannot pass; its dtype and ``index_topk`` checks run).

The direct exchange's checks, read from 0.34.0's ``dcp_topk_direct.py`` and
``dcp_topk_pingpong_cutedsl.py`` (it calls no ``csrc``): ``DirectDCPTopKWorkspace.merge`` asserts
``0 < rows <= max_rows`` in Python (that line runs as the release has it); the selector's ``__init__``
asserts the candidate count a multiple of its 512-thread block and both key widths in ``(0, 32]``; its
``cute.compile`` fixes the signature the compiled (TVM-FFI) function checks each call against: the
inboxes ``float32 [2, max_rows, num_candidates, 2]`` with the workspace's strides, 8-byte aligned; the
epoch ``int64 [1]``; the output ``int32 [rows, topk]`` with unit inner stride. Left out, and said so:
the CUDA-device checks (a CPU run has none) and the Triton launch's own pointer checks (its tensors
are the workspace's, not the code under test's). The real function's words are not known on CPU: the
messages here are ours; ``real_pingpong_answers`` records the compiled one's on a GPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from packaging.version import Version

INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"
CUTEDSL = "vllm.model_executor.kernels.attention.dsa.dcp_indexer_cutedsl"
DIRECT = "vllm.model_executor.kernels.attention.dsa.dcp_topk_direct"
PINGPONG = "vllm.model_executor.kernels.attention.dsa.dcp_topk_pingpong_cutedsl"
TB_SIZE = 512  # both selectors' thread block: whole slices of candidates per thread

# check name -> (first release with it, last release with it or None); the direct exchange is 0.34.0's
TOPK_CHECKS: dict[str, tuple[str, str | None]] = {
    "candidates_multiple_of_block": ("0.34.0", None),
    "score_bits_range": ("0.34.0", None),
    "id_bits_range": ("0.34.0", None),
    "inbox_dtype": ("0.34.0", None),
    "inbox_shape": ("0.34.0", None),
    "inbox_strides": ("0.34.0", None),
    "inbox_aligned": ("0.34.0", None),
    "epoch_dtype": ("0.34.0", None),
    "epoch_shape": ("0.34.0", None),
    "out_dtype": ("0.34.0", None),
    "out_rank": ("0.34.0", None),
    "out_topk": ("0.34.0", None),
    "out_inner_stride": ("0.34.0", None),
}


def has_check(name: str, version: Version) -> bool:
    import kernel_contracts as kc

    return kc.has_check(name, version, TOPK_CHECKS)


class KernelRefusal(RuntimeError):
    """What the compiled selector refuses (an assertion at compile, an argument check at call); ``check``
    names the check of :data:`TOPK_CHECKS` (None for the gathered selector's compile assertions)."""

    def __init__(self, message: str, check: str | None = None) -> None:
        super().__init__(message)
        self.check = check


# --------------------------------------------------------------------------------------------
# what the kernels compute
# --------------------------------------------------------------------------------------------
def score_keys(scores: Any, score_bits: int) -> Any:
    """The selectors' order-preserving score key: the float's bits, flipped so unsigned order is float
    order, keeping the high ``score_bits`` (int64, non-negative)."""
    import torch

    bits = scores.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
    key = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    return key >> (32 - score_bits)


def select_rows(scores: Any, ids: Any, topk: int, score_bits: int, id_bits: int) -> Any:
    """Each row's ``topk`` candidates of highest score key, the smaller id first among equal keys,
    ``-1`` padded: ``[rows, C]`` scores and ids -> ``[rows, topk]`` int32 ids (best first; the kernels
    write them in the order their atomics commit, which no reader depends on)."""
    import torch

    ids = ids.long()
    mask = (1 << id_bits) - 1
    valid = ids >= 0
    # the order: score key, then the smaller (masked) id; a padding candidate after every valid one.
    # Two stable sorts, the minor key first (one 64-bit key would overflow int64).
    by_id = torch.argsort(torch.where(valid, ids & mask, torch.full_like(ids, 1 << 40)), dim=1, stable=True)
    key = torch.where(valid, score_keys(scores, score_bits) + 1, torch.zeros_like(ids))
    order = torch.gather(by_id, 1, torch.argsort(torch.gather(key, 1, by_id), dim=1, descending=True,
                                                 stable=True))[:, :topk]
    picked = torch.gather(ids & mask, 1, order)
    picked = torch.where(torch.gather(valid, 1, order), picked, torch.full_like(picked, -1))
    if picked.shape[1] < topk:
        picked = torch.cat([picked, picked.new_full((picked.shape[0], topk - picked.shape[1]), -1)], 1)
    return picked.to(torch.int32)


def _check(name: str, ok: bool, message: str, version: Version) -> None:
    if has_check(name, version) and not ok:
        raise KernelRefusal(message, name)


class PackStandIn:
    """``_PACK_DCP_TOPK_CANDIDATES_KERNEL``: per row and candidate, the logit the local index names
    (``-inf`` for ``-1``) and the index's global token id (``-1`` for ``-1``), into ``packed[..., 0/1]``."""

    def __init__(self, calls: dict[str, int]) -> None:
        self.calls = calls

    def __call__(self, logits: Any, topk_indices: Any, packed: Any, row_starts_arg: Any, *, num_cols: int,
                 dcp_rank: int, dcp_world_size: int, cp_interleave: int, has_row_starts: bool, topk: int,
                 **strides_and_block: int) -> None:
        import torch

        self.calls["topk_pack"] = self.calls.get("topk_pack", 0) + 1
        rows = topk_indices.shape[0]
        local = topk_indices[:, :topk].long()
        valid = local >= 0
        safe = local.clamp_min(0)
        start = row_starts_arg[:rows].long()[:, None] if has_row_starts else torch.zeros_like(safe[:, :1])
        col = (safe + start).clamp_max(max(num_cols - 1, 0))
        if num_cols == 0 and bool(valid.any()):
            raise RuntimeError("DCP top-k pack: a valid local index into an empty logits row (out of bounds)")
        score = torch.full(local.shape, float("-inf"), dtype=torch.float32)
        if num_cols > 0:
            score = torch.where(valid, torch.gather(logits[:rows].float(), 1, col), score)
        world_i = dcp_world_size * cp_interleave
        gid = (safe // cp_interleave) * world_i + dcp_rank * cp_interleave + safe % cp_interleave
        gid = torch.where(valid, gid, torch.full_like(gid, -1))
        packed[:rows, :topk, 0] = score
        packed[:rows, :topk, 1] = gid.float()


class GatheredSelectorStandIn:
    """``_STABLE_TOPK_FROM_GATHERED_CANDIDATES_KERNEL``: its compile key's assertions, then the stable
    top-k of every rank's candidates (0.34.0: rank-major ``[world, rows, topk, 2]``; 0.33.0 and before:
    ``[rows, world * topk, 2]``)."""

    def __init__(self, calls: dict[str, int]) -> None:
        self.calls = calls

    def __call__(self, gathered: Any, out: Any, *, topk: int, score_bits: int = 32, id_bits: int = 32) -> None:
        self.calls["topk_select_gathered"] = self.calls.get("topk_select_gathered", 0) + 1
        cands = gathered.permute(1, 0, 2, 3).reshape(gathered.shape[1], -1, 2) if gathered.dim() == 4 else gathered
        num_candidates = cands.shape[1]
        # StableTopKFromGatheredCandidatesKernel.kernel(compile_key)'s assertions
        if not (0 < score_bits <= 32 and 0 < id_bits <= 32):
            raise KernelRefusal("score_bits and id_bits must be in (0, 32]")
        if num_candidates % TB_SIZE:
            raise KernelRefusal(f"candidate count must be a multiple of {TB_SIZE}, got {num_candidates}")
        if topk % TB_SIZE:
            raise KernelRefusal(f"Expected topk={topk} to be a multiple of tb_size={TB_SIZE}")
        out[: cands.shape[0]] = select_rows(cands[..., 0], cands[..., 1].long(), topk, score_bits, id_bits)


# --------------------------------------------------------------------------------------------
# the direct exchange (0.34.0)
# --------------------------------------------------------------------------------------------
def check_pingpong(version: Version, *, topk: int, num_candidates: int, max_rows: int, score_bits: int,
                   id_bits: int, inboxes: Any, write_seq: Any, out: Any) -> None:
    """The compiled ping-pong selector's checks of release ``version``: its ``__init__`` assertions,
    then the argument checks of the function ``cute.compile`` built, in argument order."""
    import torch

    _check("candidates_multiple_of_block", num_candidates % TB_SIZE == 0,
           f"Stable top-k requires candidate count to be a multiple of {TB_SIZE}, got {num_candidates}", version)
    _check("score_bits_range", 0 < score_bits <= 32, "score_bits must be in (0, 32]", version)
    _check("id_bits_range", 0 < id_bits <= 32, "id_bits must be in (0, 32]", version)
    _check("inbox_dtype", inboxes.dtype == torch.float32, "inboxes: expected float32", version)
    _check("inbox_shape", tuple(inboxes.shape) == (2, max_rows, num_candidates, 2),
           f"inboxes: expected shape (2, {max_rows}, {num_candidates}, 2), got {tuple(inboxes.shape)}", version)
    _check("inbox_strides", inboxes.dim() != 4 or tuple(inboxes.stride()) == (max_rows * num_candidates * 2,
                                                                            num_candidates * 2, 2, 1),
           f"inboxes: strides {tuple(inboxes.stride())} are not the compiled ones", version)
    _check("inbox_aligned", inboxes.data_ptr() % 8 == 0, "inboxes: not 8-byte aligned", version)
    _check("epoch_dtype", write_seq.dtype == torch.int64, "write_seq: expected int64", version)
    _check("epoch_shape", tuple(write_seq.shape) == (1,), "write_seq: expected shape (1,)", version)
    _check("out_dtype", out.dtype == torch.int32, "out: expected int32", version)
    _check("out_rank", out.dim() == 2, "out: expected 2 dimensions", version)
    _check("out_topk", out.dim() == 2 and out.shape[1] == topk,
           f"out: expected {topk} columns, got {tuple(out.shape)}", version)
    _check("out_inner_stride", out.dim() != 2 or out.stride(1) == 1, "out: inner stride must be 1", version)


def pingpong_compile(version: Version, calls: dict[str, int]) -> Callable[..., Callable[..., None]]:
    """``StableTopKFromPingPongCandidatesKernel.compile``: the compiled function, whose call checks its
    arguments (:func:`check_pingpong`) and selects from the inbox slot the latest epoch wrote."""

    def compile(topk: int, num_candidates: int, max_rows: int, use_pdl: bool, score_bits: int = 32,
                id_bits: int = 32) -> Callable[..., None]:
        def run(inboxes: Any, write_seq: Any, out: Any) -> None:
            check_pingpong(version, topk=topk, num_candidates=num_candidates, max_rows=max_rows,
                           score_bits=score_bits, id_bits=id_bits, inboxes=inboxes, write_seq=write_seq, out=out)
            calls["topk_select_pingpong"] = calls.get("topk_select_pingpong", 0) + 1
            slot = (int(write_seq[0]) - 1) & 1
            rows = out.shape[0]
            box = inboxes[slot, :rows]
            out.copy_(pingpong_select(box[..., 0], box[..., 1].long(), topk, score_bits, id_bits))

        return run

    return compile


def pingpong_select(scores: Any, ids: Any, topk: int, score_bits: int, id_bits: int) -> Any:
    """The ping-pong selector on ``[rows, C]`` candidates: a row of at most ``topk`` valid ids keeps them
    all (in candidate order, ``-1`` after), a fuller one its stable top-k; ids are written unmasked."""
    import torch

    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int32)
    for r in range(scores.shape[0]):
        keep = ids[r] >= 0
        if int(keep.sum()) <= topk:
            got = ids[r][keep]
            out[r, : got.numel()] = got.to(torch.int32)
        else:
            out[r] = select_rows(scores[r : r + 1], ids[r : r + 1], topk, score_bits, 32)[0]
    return out


class _Launch:
    """A Triton ``kernel[grid](...)`` launch: ``run`` with the launch's arguments."""

    def __init__(self, run: Callable[..., None]) -> None:
        self.run = run

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return self.run


class SymmetricStore:
    """The top-k workspace's symmetric allocations on CPU: each a plain tensor, its pointer table
    holding its own address in this rank's slot (what the push and publish stand-ins look up)."""

    def __init__(self) -> None:
        self.by_address: dict[int, Any] = {}

    def allocate(self, workspace: Any, shape: tuple[int, ...], dtype: Any) -> tuple[Any, Any]:
        import torch

        storage = torch.zeros(shape, dtype=dtype)
        ptrs = torch.zeros((workspace.num_ubatches, workspace.world_size), dtype=torch.int64)
        ptrs[:, workspace.rank] = storage.data_ptr()
        self.by_address[storage.data_ptr()] = storage
        workspace._allocations.append((storage, None, [storage]))
        return storage, ptrs

    def own(self, ptrs: Any, rank: int) -> Any:
        return self.by_address[int(ptrs[rank])]


def direct_standins(group: Callable[[], Any], store: SymmetricStore,
                    calls: dict[str, int]) -> tuple[_Launch, _Launch]:
    """The push and publish kernels over the gloo group ``group()``: every rank's packed candidates
    land in every inbox at ``[slot, row, source rank]``; publishing bumps this rank's epoch and waits
    for every peer's (a peer that never arrives is the kernel's trap)."""
    import torch
    import torch.distributed as dist

    def push(peer_inbox_ptrs: Any, write_seq: Any, packed: Any, num_elems: int, *, my_rank: int, world_size: int,
             local_elems: int, slot_elems: int, block_size: int, launch_pdl: bool) -> None:
        calls["topk_push"] = calls.get("topk_push", 0) + 1
        mine = packed.reshape(-1)[:num_elems].contiguous()
        parts = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(parts, mine, group=group())
        inbox = store.own(peer_inbox_ptrs, my_rank).reshape(-1)
        slot = int(write_seq.reshape(-1)[0]) & 1
        rows = num_elems // local_elems
        for src, part in enumerate(parts):
            for row in range(rows):
                dst = slot * slot_elems + (row * world_size + src) * local_elems
                inbox[dst:dst + local_elems] = part[row * local_elems:(row + 1) * local_elems]

    def publish(peer_signal_ptrs: Any, *, my_rank: int, world_size: int, block_size: int, max_spins: int,
                launch_pdl: bool) -> None:
        signal = store.own(peer_signal_ptrs, my_rank).reshape(-1)
        signal[0] += 1
        epochs = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(epochs, signal[:1].clone(), group=group())
        if any(int(e) < int(signal[0]) for e in epochs):
            raise RuntimeError(f"DCP top-k publish: a peer never reached epoch {int(signal[0])} (the kernel traps)")

    return _Launch(push), _Launch(publish)


# --------------------------------------------------------------------------------------------
# installing
# --------------------------------------------------------------------------------------------
class _AsOnCuda:
    """The logits as the merge's support check sees them on a GPU: a CUDA tensor of the same dtype."""

    class device:
        type = "cuda"

    def __init__(self, tensor: Any) -> None:
        self.dtype = tensor.dtype


def install(version: Version, group: Callable[[], Any], calls: dict[str, int]) -> bool:
    """The stand-ins above in the release under test, over the gloo group ``group()`` (the DCP group's
    ``device_group``); ``calls`` counts each kernel's launches. False where the release has no DCP
    top-k merge."""
    try:
        indexer = importlib.import_module(INDEXER)
        cutedsl = importlib.import_module(CUTEDSL)
    except ImportError:
        return False
    if not hasattr(indexer, "_merge_dcp_topk_global"):
        return False
    cutedsl._PACK_DCP_TOPK_CANDIDATES_KERNEL = PackStandIn(calls)
    cutedsl._STABLE_TOPK_FROM_GATHERED_CANDIDATES_KERNEL = GatheredSelectorStandIn(calls)
    real_check = getattr(indexer, "_release_assert_cutedsl_dcp_merge_supported", None)
    if real_check is None:
        real_check = indexer._assert_cutedsl_dcp_merge_supported
        indexer._release_assert_cutedsl_dcp_merge_supported = real_check
    indexer._assert_cutedsl_dcp_merge_supported = lambda logits, topk, k: real_check(_AsOnCuda(logits), topk, k)
    try:
        direct = importlib.import_module(DIRECT)
        pingpong = importlib.import_module(PINGPONG)
    except ImportError:  # before 0.34.0: the all-gather only
        return True
    if not hasattr(direct.triton, "next_power_of_2"):  # vLLM's Triton placeholder on CPU (the publish grid)
        direct.triton.next_power_of_2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()
    store = SymmetricStore()
    direct.DirectDCPTopKWorkspace._allocate = lambda self, shape, dtype: store.allocate(self, shape, dtype)
    direct._push_candidates_kernel, direct._publish_and_wait_kernel = direct_standins(group, store, calls)
    pingpong.StableTopKFromPingPongCandidatesKernel.compile = staticmethod(pingpong_compile(version, calls))
    direct.get_direct_dcp_topk_workspace.cache_clear()
    return True


# --------------------------------------------------------------------------------------------
# the cases the stand-in and the compiled selector are held to (one GPU: test_dcp_topk_standins.py)
# --------------------------------------------------------------------------------------------
TOPK, MAX_ROWS, WORLD, ROWS = 512, 4, 2, 3
PINGPONG_CASES: dict[str, dict[str, Any]] = {
    "accepted": {},
    "candidates_not_whole_blocks": {"candidates_per_rank": 384},
    "score_bits_zero": {"score_bits": 0},
    "id_bits_over_32": {"id_bits": 33},
    "fp16_inboxes": {"inbox_dtype": "float16"},
    "inboxes_of_other_capacity": {"inbox_rows": MAX_ROWS + 1},
    "strided_inboxes": {"inbox_strided": True},
    "misaligned_inboxes": {"inbox_offset": 1},
    "int32_epoch": {"epoch_dtype": "int32"},
    "two_epochs": {"epochs": 2},
    "int64_out": {"out_dtype": "int64"},
    "flat_out": {"out_flat": True},
    "out_of_other_topk": {"out_topk": 256},
    "transposed_out": {"out_transposed": True},
}


def pingpong_arguments(case: str, device: str = "cpu") -> dict[str, Any]:
    """The compile key and call arguments of ``case`` (``compile`` gets the key, its result the call)."""
    import torch

    spec = PINGPONG_CASES[case]
    cand = spec.get("candidates_per_rank", TOPK) * WORLD
    rows = spec.get("inbox_rows", MAX_ROWS)
    dtype = getattr(torch, spec.get("inbox_dtype", "float32"))
    inboxes = torch.zeros(2, rows, cand, 2, dtype=dtype, device=device)
    if spec.get("inbox_strided"):
        inboxes = torch.zeros(2, rows, cand, 4, dtype=dtype, device=device)[..., ::2]
    if spec.get("inbox_offset"):  # one float past an aligned start: 4-byte aligned, not 8
        inboxes = torch.zeros(2 * rows * cand * 2 + 1, dtype=dtype, device=device)[1:].view(2, rows, cand, 2)
    inboxes[..., 1] = -1  # every candidate padding: nothing is read past the arguments
    write_seq = torch.ones(spec.get("epochs", 1), dtype=getattr(torch, spec.get("epoch_dtype", "int64")), device=device)
    out_dtype = getattr(torch, spec.get("out_dtype", "int32"))
    ncols = spec.get("out_topk", TOPK)
    out = torch.zeros(ROWS, ncols, dtype=out_dtype, device=device)
    if spec.get("out_transposed"):
        out = torch.zeros(ncols, ROWS, dtype=out_dtype, device=device).t()
    if spec.get("out_flat"):
        out = torch.zeros(ROWS * ncols, dtype=out_dtype, device=device)
    key = {"topk": TOPK, "num_candidates": cand, "max_rows": MAX_ROWS, "use_pdl": False,
           "score_bits": spec.get("score_bits", 32), "id_bits": spec.get("id_bits", 32)}
    return {"key": key, "inboxes": inboxes, "write_seq": write_seq, "out": out}


def stand_in_pingpong_answer(version: Version, case: str) -> str:
    """``"accepted"`` or the name of the check of :data:`TOPK_CHECKS` that refuses ``case``."""
    a = pingpong_arguments(case)
    key = {k: v for k, v in a["key"].items() if k != "use_pdl"}
    try:
        check_pingpong(version, **key, inboxes=a["inboxes"], write_seq=a["write_seq"], out=a["out"])
    except KernelRefusal as exc:
        return str(exc.check)
    return "accepted"


def real_pingpong_answers() -> dict[str, dict[str, Any]]:
    """On a CUDA machine: what the compiled ping-pong selector of the installed release says to each
    case (refused or accepted, and its own words)."""
    import torch

    pingpong = importlib.import_module(PINGPONG)
    answers: dict[str, dict[str, Any]] = {}
    for case in PINGPONG_CASES:
        a = pingpong_arguments(case, "cuda")
        try:
            pingpong.StableTopKFromPingPongCandidatesKernel.compile(**a["key"])(a["inboxes"], a["write_seq"], a["out"])
            torch.cuda.synchronize()
            answers[case] = {"refused": False, "message": ""}
        except Exception as exc:  # an AssertionError at compile, a TVM-FFI argument error at call
            answers[case] = {"refused": True, "message": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}
    return answers


# --------------------------------------------------------------------------------------------
# two gloo ranks through the release's merge, each exchange (test_dcp_topk_standins.py)
# --------------------------------------------------------------------------------------------
MERGE_ROWS = (1300, 1100, 700, 1, 0)  # per row: the positions it sees (a row past 2 * TOPK, one a rank owns none of)


def merge_scores(row: int, length: int, seed: int) -> Any:
    """Row ``row``'s scores over its ``length`` positions: distinct, the same on every rank."""
    import torch

    gen = torch.Generator().manual_seed(1000 * seed + row)
    return torch.randperm(max(length, 1), generator=gen)[:length].double().div(64).exp2().float()


def merge_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str, sys_path: list[str]) -> None:
    """Each row's local top-k on this rank, merged by the release's ``_merge_dcp_topk_global`` over the
    all-gather and (0.34.0) twice over the direct exchange (both ping-pong slots); ``rank<r>.json``."""
    import json
    import os
    import sys
    from pathlib import Path

    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    os.environ["VLLM_USE_DIRECT_DCP_A2A"] = "1"
    report: dict[str, Any] = {"rank": rank, "world": world, "merges": {}}
    try:
        import compat
        import glm5_path as g
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import (
            get_dcp_group,
            init_distributed_environment,
            initialize_model_parallel,
        )

        vc = g.make_vllm_config(g.write_model_dir(Path(model_dir)), world)
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(tensor_model_parallel_size=world, decode_context_model_parallel_size=world)
            calls: dict[str, int] = {}
            install(compat.vllm_version(), lambda: get_dcp_group().device_group, calls)
            indexer = importlib.import_module(INDEXER)
            takes = set(importlib.import_module("inspect").signature(indexer._merge_dcp_topk_global).parameters)
            runs = [("all_gather", 0, 1)]
            if "direct_max_rows" in takes:
                runs += [("direct", 8, 2), ("direct_again", 8, 3)]
            for name, direct_max_rows, seed in runs:
                logits, local = merge_local(rank, world, seed)
                before = dict(calls)
                extra = {"direct_max_rows": direct_max_rows, "num_positions": 8192}
                indexer._merge_dcp_topk_global(logits, local, TOPK, rank, world, 1,
                                               **{k: v for k, v in extra.items() if k in takes})
                report["merges"][name] = {"seed": seed, "ids": local.tolist(),
                                          "kernels": {k: v - before.get(k, 0) for k, v in calls.items()
                                                      if v - before.get(k, 0)}}
            get_dcp_group().barrier()
    except Exception as exc:
        from ranks import fatal_report

        report.update(fatal_report(exc))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def merge_local(rank: int, world: int, seed: int) -> tuple[Any, Any]:
    """This rank's logits over its positions (interleave 1) and each row's local top-k of them."""
    import torch

    width = max(1, max((n + world - 1 - rank) // world for n in MERGE_ROWS))
    logits = torch.full((len(MERGE_ROWS), width), float("-inf"))
    local = torch.full((len(MERGE_ROWS), TOPK), -1, dtype=torch.int32)
    for row, n in enumerate(MERGE_ROWS):
        mine = merge_scores(row, n, seed)[rank::world]
        logits[row, : mine.numel()] = mine
        best = torch.argsort(mine, descending=True)[:TOPK]
        local[row, : best.numel()] = best.to(torch.int32)
    return logits, local


def merge_expected(seed: int) -> list[set[int]]:
    """Each row's global top-k positions (the highest ``TOPK`` scores of all its positions)."""
    import torch

    return [set(torch.argsort(merge_scores(row, n, seed), descending=True)[:TOPK].tolist())
            for row, n in enumerate(MERGE_ROWS)]
