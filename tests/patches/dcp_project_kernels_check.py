"""Check dcp-project-before-merge's Triton kernels (``vllm.v1.attention.ops.dcp_project``).

Run as a script, one process standing in for every rank: on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported), on a GPU natively. For each layout
(ag_rs reduce-scatter chunks, NCCL a2a send rows, direct a2a peer receive slots) the ranks'
kernel outputs are exchanged the way the transport would (sum of chunks, row exchange,
shared receive buffers) and the merged result is compared with a float64 reference: LSE
merge of the ranks' latent partials (NaN partials of masked rows included), then projection.
Prints one JSON line: {"checks": [{"name", "err", "ref_max"}...]}.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

MISSING = 3  # exit status: vLLM has no dcp_project module (the unpatched base)


def reference(xs, lses, w_uv, rank: int, world: int):
    """Rank ``rank``'s merged heads [B, H/N, V] in float64: vLLM's reference LSE merge of the
    latent partials (``_lse_weighted_combine``), then the projection."""
    import compat
    import torch

    _lse_weighted_combine = compat.symbol("dcp_alltoall", "_lse_weighted_combine")

    merged = _lse_weighted_combine(torch.stack([x.double() for x in xs]),
                                   torch.stack([lv.double() for lv in lses]))  # [B, H, L]
    hpr = merged.shape[1] // world
    heads = slice(rank * hpr, (rank + 1) * hpr)
    return torch.einsum("bhl,hlv->bhv", merged[:, heads], w_uv.double()[heads])


def _workspace(rank: int, world: int, hpr: int, v: int, capacity: int, dtype, device):
    """A stand-in for one rank's ``DirectDCPA2AWorkspace`` (one ubatch); peer tables set later."""
    import torch

    return SimpleNamespace(
        world_size=world, rank=rank, heads_per_rank=hpr, head_dim=v, max_num_tokens=capacity,
        received_output=torch.full((1, 2, world, capacity, hpr, v), float("nan"), dtype=dtype, device=device),
        received_lse=torch.full((1, 2, world, capacity, hpr), float("nan"), device=device),
        received_signal=torch.zeros((1, 2, world), dtype=torch.int32, device=device),
        epoch=torch.zeros(1, dtype=torch.int64, device=device))


def main() -> int | None:
    import torch

    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    if device == "cpu":  # vLLM disables Triton without a GPU driver; the interpreter needs none
        import triton
        import triton.language as tl
        import vllm.triton_utils as tu

        tu.triton, tu.tl = triton, tl
    import compat

    try:
        from vllm.v1.attention.ops import dcp_project as dp
    except ImportError as exc:  # the module the patch adds: its absence is the failure the test is about
        print(f"no vllm.v1.attention.ops.dcp_project, which the patch adds ({exc})", file=sys.stderr)
        return MISSING

    mask_dcp_empty_shards_ = compat.symbol("ops_common", "mask_dcp_empty_shards_")  # moved in 0.29.0

    # Triton's interpreter mishandles bf16 tiles (tl.dot of bf16 gives garbage); the kernels
    # are dtype-generic, so on CPU they run in fp16.
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(5)
    checks = []

    def record(name: str, got, ref) -> None:
        err = float((got.double().cpu() - ref.cpu()).abs().max())
        checks.append({"name": name, "err": err, "ref_max": float(ref.abs().max())})

    if os.environ.get("DCP_PROJECT_UNANSWERED_PEER"):
        return unanswered_peer(dp, device, int(os.environ["DCP_PROJECT_UNANSWERED_PEER"]))

    # masked_lse == mask_dcp_empty_shards_ (sequence bounds, empty shards)
    lse = torch.randn(9, 6, generator=gen)
    seq_lens = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3, 6, 7], dtype=torch.int32)  # rows 7, 8 past the last bound
    want = lse.clone()
    mask_dcp_empty_shards_(want, seq_lens, qsl)
    got = dp.masked_lse(lse.to(device), seq_lens.to(device), qsl.to(device))
    checks.append({"name": "masked_lse", "err": float((got.cpu() == want).logical_not().sum()), "ref_max": 1.0})

    for world, hpr, lora, v, tokens in ((2, 2, 64, 32, 5), (4, 1, 128, 48, 19), (2, 4, 64, 32, 40)):
        heads = world * hpr
        w_uv = (torch.randn(heads, lora, v, generator=gen) / lora**0.5).to(dtype)
        xs, lses = [], []
        for r in range(world):
            x = torch.randn(tokens, heads, lora, generator=gen).to(dtype)
            lv = torch.randn(tokens, heads, generator=gen) * 3
            x[r % tokens] = float("nan")  # a masked row: garbage partial, no weight
            lv[r % tokens] = float("-inf")
            xs.append(x)
            lses.append(lv)
        refs = [reference(xs, lses, w_uv, r, world) for r in range(world)]
        dev = [x.to(device) for x in xs]
        w_dev = w_uv.to(device)
        tag = f"N{world} H{heads} L{lora} V{v} T{tokens}"

        # ag_rs: rank d's merged heads = sum over ranks of their chunk d
        gathered = torch.stack(lses).to(device)
        chunks = [dp.project_for_reduce_scatter(dev[r], w_dev, gathered, r, world) for r in range(world)]
        for d in range(world):
            merged = sum(c[d].float() for c in chunks).to(dtype)
            record(f"ag_rs {tag} rank{d}", merged, refs[d])

        # NCCL a2a: rank d receives chunk d of every rank's send rows
        row = -(-(v + 2) // 8) * 8
        sends = []
        for r in range(world):
            send = torch.full((world, hpr, tokens, row), float("nan"), dtype=dtype, device=device)
            dp.project_into_a2a_send(dev[r], w_dev, lses[r].to(device), send, world)
            sends.append(send)
        for d in range(world):
            recv = torch.stack([s[d] for s in sends])
            out = torch.full((tokens, hpr, v), float("nan"), dtype=dtype, device=device)
            dp.merge_a2a_recv(recv, v, out)
            record(f"nccl_a2a {tag} rank{d}", out, refs[d])

        # direct a2a: N stand-in workspaces whose peer tables point at each other's buffers
        spaces = [_workspace(r, world, hpr, v, tokens + 3, dtype, device) for r in range(world)]
        for ws in spaces:
            for name in ("output", "lse", "signal"):
                table = [getattr(p, f"received_{name}")[0].data_ptr() for p in spaces]
                setattr(ws, f"peer_{name}_ptrs", torch.tensor([table], dtype=torch.int64, device=device))
        for step in range(3):  # both parity slots, then the first again
            outs = []
            for r in range(world):  # each rank projects and signals before any rank merges
                out = torch.full((tokens, hpr, v), float("nan"), dtype=dtype, device=device)
                ws = spaces[r]
                dp.dispatch_direct(ws, 0, dev[r], w_dev, lses[r].to(device))
                outs.append(out)
            for r in range(world):
                ws = spaces[r]
                assert int(ws.epoch) == step + 1
                assert ws.received_signal[0][(step + 1) % 2].tolist() == [step + 1] * world
                dp.merge_direct(ws, 0, outs[r], True)
                record(f"direct_a2a {tag} step{step} rank{r}", outs[r], refs[r])
        if device == "cuda":  # decode: every rank's dispatch and merge captured, replayed twice
            outs = [torch.full((tokens, hpr, v), float("nan"), dtype=dtype, device=device)
                    for _ in range(world)]
            lse_dev = [lv.to(device) for lv in lses]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for r in range(world):
                    dp.dispatch_direct(spaces[r], 0, dev[r], w_dev, lse_dev[r])
                for r in range(world):
                    dp.merge_direct(spaces[r], 0, outs[r], True)
            for replay in range(2):  # epochs 4 and 5: both parity slots under replay
                for o in outs:
                    o.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                assert int(spaces[0].epoch) == 4 + replay
                for r in range(world):
                    record(f"direct_a2a graph {tag} replay{replay} rank{r}", outs[r], refs[r])
    print(json.dumps({"device": device, "checks": checks}))


def unanswered_peer(dp, device: str, max_spins: int) -> int:
    """Rank 0 of two projects and signals; rank 1 never does. Rank 0's merge must end within
    ``max_spins`` polls with the kernel's message (rank, source, epoch) and a failed launch, not
    hang. Prints {"max_spins", "seconds"} once the failure reaches the host."""
    import time

    import torch

    dtype = torch.bfloat16
    hpr, lora, v, tokens = 2, 64, 32, 4
    spaces = [_workspace(r, 2, hpr, v, tokens, dtype, device) for r in range(2)]
    for ws in spaces:
        for name in ("output", "lse", "signal"):
            table = [getattr(p, f"received_{name}")[0].data_ptr() for p in spaces]
            setattr(ws, f"peer_{name}_ptrs", torch.tensor([table], dtype=torch.int64, device=device))
    x = torch.randn(tokens, 2 * hpr, lora, device=device).to(dtype)
    w_uv = torch.randn(2 * hpr, lora, v, device=device).to(dtype)
    lse = torch.randn(tokens, 2 * hpr, device=device)
    out = torch.empty(tokens, hpr, v, dtype=dtype, device=device)
    dp.dispatch_direct(spaces[0], 0, x, w_uv, lse)  # rank 1 never dispatches
    torch.cuda.synchronize()
    start = time.monotonic()
    try:
        dp.merge_direct(spaces[0], 0, out, True, max_spins=max_spins)
        torch.cuda.synchronize()
    except RuntimeError as exc:
        print(json.dumps({"max_spins": max_spins, "seconds": time.monotonic() - start,
                          "error": str(exc).splitlines()[0]}), flush=True)
        return 1
    print(json.dumps({"max_spins": max_spins, "seconds": time.monotonic() - start,
                      "error": None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
