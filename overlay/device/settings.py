"""The device machine's facts and the settings a person may change: what it has, what vLLM needs there,
which kernels and files go, the carry size. Read this first; the other modules follow from it."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from overlay.errors import OverlayError

MIB = 2**20
CARRY_LIMIT = 60 * MIB
CALL_LIMIT = 64 * MIB  # what one device call carries in all: the carry plus the checkout's own files
MANIFEST_RESERVE = MIB  # room kept in every carry for its copy of manifest.json
XZ_PRESET = 6
STUB_LABEL = "device"
TORCH_FAMILY = frozenset({"torch", "torchvision", "torchaudio"})
# What the overlay's own modules that run on the device import beyond vLLM's requirements
# (overlay.bench.engine, overlay.regress), pinned as in pyproject.toml (its pin is the source;
# tests/test_device_stage.py fails when the two part): `overlay device-stage` adds them to its --extra
# requirements.
HARNESS_REQUIREMENTS: tuple[str, ...] = ("httpx-sse==0.4.3",)

# vLLM requirements (or their dependencies) that no engine run of a text-only sparse-MLA model on
# Hopper imports, each with why; left out unless ``full`` (about half of the bytes: 8 carries).
# numba stays although it is imported lazily: without vLLM's numba==0.65 the device's numpy 2.5
# stays pinned and pip backtracks xgrammar into versions that need transformers < 5.
NOT_NEEDED: dict[str, str] = {
    "tokenspeed-mla": "TokenSpeed MLA backends; Hopper sparse MLA runs FlashMLA-sparse",
    "tokenspeed-triton": "TokenSpeed's Triton fork (for tokenspeed-mla)",
    "humming-kernels": "JIT kernels of other models; its [cu13] extra brings CUDA 13.5 nvcc/nvvm "
                       "(the device has its own CUDA 13.0 toolkit)",
    "nvidia-cuda-nvcc": "CUDA 13.5 compiler wheel (for humming-kernels); the device has nvcc 13.0",
    "nvidia-nvvm": "CUDA 13.5 NVVM wheel (for humming-kernels)",
    "nvidia-cuda-crt": "CUDA 13.5 runtime headers wheel (for humming-kernels)",
    "nvidia-cuda-cccl": "CUDA 13.5 CCCL headers wheel (for humming-kernels)",
    "tilelang": "TileLang kernels (vllm/tilelang_utils: mHC of other models)",
    "z3-solver": "SMT solver of tilelang",
    "pynvvideocodec": "video decoding (vllm/multimodal/video.py)",
    "torchcodec": "video/audio decoding (multimodal inputs); built for torch 2.13, not the device's 2.11",
    "nvidia-cutlass-dsl-libs-cu12": "CuteDSL's CUDA 12 libraries; the [cu13] ones serve the device's CUDA 13",
}

# Markers of the device's interpreter: CPython 3.12.3 on Linux x86_64.
DEVICE_ENV: dict[str, str] = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "platform_release": "",
    "platform_version": "",
}

# Binary wheels for the device; glibc of the device (Python 3.12.3: Ubuntu 24.04) is newer than
# every tag listed, newest first so that pip prefers the most specific build.
PLATFORMS: tuple[str, ...] = (
    *(f"manylinux_2_{n}_x86_64" for n in range(35, 16, -1)),
    "manylinux2014_x86_64",
    *(f"manylinux_2_{n}_x86_64" for n in range(16, 4, -1)),
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "any",
)

# Compiled libraries of the wheel that travel (each as its own .xz), and why the others stay.
KEEP_KERNELS: tuple[str, ...] = (
    "vllm/_C_stable_libtorch.abi3.so",
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/_flashmla_C.abi3.so",
    "vllm/_flashmla_extension_C.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/_flashkda_C.abi3.so",
    "vllm/_qutlass_C.abi3.so",
    "vllm/_deepselect_C.abi3.so",
    "vllm/_rust_tool_parser.abi3.so",
    "vllm/cumem_allocator.abi3.so",
    "vllm/fs_io_C.abi3.so",
    "vllm/spinloop.abi3.so",
)
# Kept kernels that a release's wheel may lack, or that may stay home when they do not load on the
# device's torch (overlay.device.torch_abi), each with why an engine run of a text-only sparse-MLA
# model on Hopper goes without it: a subset of KEEP_KERNELS (a name only here would never travel;
# tests/test_device_stage.py holds it). The others of KEEP_KERNELS are required: a wheel without one,
# or one that does not resolve against the device's torch, stops the staging.
OPTIONAL_KERNELS: dict[str, str] = {
    "vllm/_flashkda_C.abi3.so": "FlashKDA (Kimi/GLM-5-next linear attention); imported by those models only",
    "vllm/_qutlass_C.abi3.so": "QuTLASS FP4 GEMMs; vLLM imports it under contextlib.suppress(ImportError)",
    "vllm/_deepselect_C.abi3.so": "DeepSelect top-k (0.33.0; SM100 only); vLLM imports it in a try",
    "vllm/_rust_tool_parser.abi3.so": "tool-call parsing (0.28.0; gone in 0.33.0); not used by the engine check",
    "vllm/fs_io_C.abi3.so": "file-system KV offload tiering; imported by that connector only",
    "vllm/spinloop.abi3.so": "shared-memory broadcast spin loop; vLLM falls back to Python without it",
}
LEFT_OUT: tuple[tuple[str, str], ...] = (
    ("vllm/vllm-rs", "the Rust front-end binary (54 MB); the engine runs from Python"),
    ("vllm/third_party/fmha_sm100/", "Blackwell (sm100) attention kernels; the device is Hopper"),
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
     "FlashAttention 2 (308 MB, 2+ carries as .xz); Hopper uses FA3, and vLLM imports FA2 in a try"),
    ("vllm/third_party/deep_gemm/_C.cpython-",
     "vendored DeepGEMM extension: built against torch's C++ ABI, it does not load on the device's "
     "torch 2.11 (docs/ARCHITECTURE.md); a deep_gemm stand-in on PYTHONPATH takes its place"),
    ("vllm/third_party/deep_gemm/_C_extension.",
     "vendored DeepGEMM extension (0.33.0): on torch's stable ABI and resolving against the device's "
     "torch 2.11, but its kernels are JIT-compiled at run time; the engine check's deep_gemm stand-in "
     "takes its place, as on 0.28.0"),
)


class DeviceStageError(OverlayError):
    """The device staging could not resolve, fetch or pack what vLLM needs."""


_CLOCK = {"start": time.monotonic()}


def start_clock() -> float:
    """Start the clock of :func:`log`'s lines again (a staging begins); return the start."""
    _CLOCK["start"] = time.monotonic()
    return _CLOCK["start"]






def with_harness(extras: Sequence[str]) -> list[str]:
    """``extras`` with ``HARNESS_REQUIREMENTS`` first, each once."""
    return [*HARNESS_REQUIREMENTS, *(e for e in extras if e not in HARNESS_REQUIREMENTS)]


def log(message: str) -> None:
    """One progress line on stderr: ``[device-stage mm:ss] message``."""
    elapsed = int(time.monotonic() - _CLOCK["start"])
    print(f"[device-stage {elapsed // 60:02d}:{elapsed % 60:02d}] {message}", file=sys.stderr, flush=True)


