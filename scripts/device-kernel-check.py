#!/usr/bin/env python3
"""On the GPU device machine: load a rebuilt ``_C_stable_libtorch.abi3.so`` with the device's torch and
show that the whole target works, not only the edited object.

    python3 scripts/device-kernel-check.py LIB.so [--expect-message TEXT] [--out result.json]

1. ``torch.ops.load_library`` (the stable libtorch ABI: built against torch 2.13's headers, loaded
   by the device's torch 2.11).
2. The changed kernel: ``torch.ops._C.direct_dcp_a2a_lse_reduce`` called with more tokens than its
   workspace holds. ``world_size`` and ``rank`` are plain arguments and the capacity check comes
   before any peer pointer is read, so one GPU reaches the error; its text is printed and, with
   ``--expect-message``, must contain that text (``{tokens}`` and ``{capacity}`` filled in).
3. Unchanged operators of the same library against torch references: ``rms_norm`` (bf16) and the
   CUTLASS sm90 ``cutlass_scaled_mm`` (fp8 e4m3 in, bf16 out).

Prints one JSON object (also written to ``--out``); exit 0 when every step passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def capacity_error(torch, capacity: int) -> str:
    tokens, heads, dim = capacity + 1, 4, 64
    dev = torch.device("cuda")
    bf16, i64 = torch.bfloat16, torch.int64
    partial = torch.zeros(tokens, heads, dim, dtype=bf16, device=dev)
    lse = torch.zeros(tokens, heads, dtype=torch.float32, device=dev)
    ptrs = torch.zeros(2, dtype=i64, device=dev)
    recv_out = torch.zeros(2, capacity, heads // 2, dim, dtype=bf16, device=dev)
    recv_lse = torch.zeros(2, capacity, heads // 2, dtype=torch.float32, device=dev)
    recv_sig = torch.zeros(2, 2, dtype=torch.int32, device=dev)
    epoch = torch.zeros(1, dtype=torch.int32, device=dev)
    combined = torch.zeros(tokens, heads // 2, dim, dtype=bf16, device=dev)
    try:
        torch.ops._C.direct_dcp_a2a_lse_reduce(partial, lse, None, None, ptrs, ptrs, ptrs, recv_out, recv_lse,
                                               recv_sig, epoch, combined, 2, 0, capacity, True)
    except RuntimeError as exc:
        return str(exc)
    return ""


def rms_norm_error(torch) -> float:
    torch.manual_seed(0)
    x = torch.randn(64, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, w, 1e-6)
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    return float((out.float() - ref).abs().max() / ref.abs().max())


def scaled_mm_error(torch) -> float:
    torch.manual_seed(1)
    m, k, n = 64, 256, 128
    a = (torch.randn(m, k, device="cuda") / 4).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda") / 4).to(torch.float8_e4m3fn).t()  # [k, n], column-major
    sa = torch.rand(m, 1, device="cuda", dtype=torch.float32) + 0.5
    sb = torch.rand(1, n, device="cuda", dtype=torch.float32) + 0.5
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    torch.ops._C.cutlass_scaled_mm(out, a, b, sa, sb, None)
    ref = (a.float() * sa) @ (b.float() * sb)
    return float((out.float() - ref).abs().max() / ref.abs().max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("library")
    ap.add_argument("--expect-message", default="")
    ap.add_argument("--capacity", type=int, default=1408)
    ap.add_argument("--out", default="")
    ns = ap.parse_args()
    import torch

    t0 = time.perf_counter()
    result: dict[str, object] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
                                 "library": ns.library}
    torch.ops.load_library(ns.library)
    result["load_s"] = round(time.perf_counter() - t0, 2)
    message = capacity_error(torch, ns.capacity)
    result["capacity_message"] = message
    want = ns.expect_message.format(tokens=ns.capacity + 1, capacity=ns.capacity)
    result["capacity_ok"] = bool(message) and (want in message if want else True)
    result["rms_norm_rel_err"] = rms_norm_error(torch)
    try:
        result["scaled_mm_fp8_rel_err"] = scaled_mm_error(torch)
    except RuntimeError as exc:
        result["scaled_mm_fp8_error"] = str(exc).splitlines()[0]
    ok = (result["capacity_ok"] and result["rms_norm_rel_err"] < 2e-2
          and float(result.get("scaled_mm_fp8_rel_err", 1.0)) < 2e-2)
    result["pass"] = bool(ok)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    text = json.dumps(result, indent=2)
    print(text)
    if ns.out:
        with open(ns.out, "w") as fh:
            fh.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
