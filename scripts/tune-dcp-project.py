"""Sweep the tile sizes of dcp-project-before-merge's projection kernel on one GPU.

    PYTHONPATH=<patched vllm tree> python3 scripts/tune-dcp-project.py [--tokens 1 16 ...]

For GLM-5 (v_head_dim 256) and DeepSeek-V3.2 (128) dimensions, 2 ranks x 8 heads gathered
(16 heads, kv_lora_rank 512), times ``torch.bmm`` of the gathered heads (what a plain
projection costs) and the Triton projection into the ag_rs chunk layout (LSE-corrected) with
each candidate configuration, under CUDA-graph replay (20 calls per graph, median of 30
replays). Prints a table and the best configuration per token count, as a Python dict
literal to put into ``dcp_project._project_config``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics


def _time(fn, replays: int = 30, inner: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / inner)
    return statistics.median(samples)


def main() -> None:
    import torch
    from vllm.v1.attention.ops import dcp_project as dp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 768, 8192])
    ns = ap.parse_args()
    world, heads, lora = 2, 16, 512
    best: dict[int, dict[str, int]] = {}
    for v in (256, 128):
        w = (torch.randn(heads, lora, v, device="cuda") / lora**0.5).bfloat16()
        for n in ns.tokens:
            x = torch.randn(n, heads, lora, device="cuda").bfloat16()
            lses = torch.randn(world, n, heads, device="cuda")
            out = torch.empty(heads, n, v, device="cuda", dtype=torch.bfloat16)
            t_bmm = _time(lambda x=x, w=w, out=out: torch.bmm(x.transpose(0, 1), w, out=out))
            results = []
            block_ts = [b for b in (16, 32, 64, 128) if b <= max(16, 2 * n)]
            for bt, bv, bk, warps, stages in itertools.product(block_ts, (32, 64, 128, 256), (64, 128, 256), (4, 8),
                                                               (2, 3, 4)):
                if bv > v or (bt * bv >= 128 * 256 and warps == 4) or (bt * bk * 2 + bk * bv * 2) * stages > 200_000:
                    continue
                cfg = {"BLOCK_T": bt, "BLOCK_V": bv, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
                dp._project_config = lambda _n, cfg=cfg: dict(cfg)
                try:
                    t = _time(lambda x=x, w=w, lses=lses: dp.project_for_reduce_scatter(x, w, lses, 0, world))
                except Exception as exc:  # e.g. out of shared memory
                    print(f"V={v} T={n} {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
                    continue
                results.append((t, cfg))
            results.sort(key=lambda r: r[0])
            t_best, cfg_best = results[0]
            print(f"V={v:4d} T={n:5d}  bmm {t_bmm:8.1f} us  triton best {t_best:8.1f} us "
                  f"({t_bmm / t_best:.2f}x)  {cfg_best}")
            for t, cfg in results[1:4]:
                print(f"{'':34s}{t:8.1f} us  {cfg}")
            if v == 256:
                best[n] = cfg_best
    print("best (GLM-5 dims):", best)


if __name__ == "__main__":
    main()
