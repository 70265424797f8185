"""Rebuilt kernel binaries (from ``make image``'s kernel stage) as overlay build inputs."""

from __future__ import annotations

from pathlib import Path

from overlay.errors import OverlayError


def collect_kernels(directory: Path) -> dict[str, Path]:
    """Map archive paths (``vllm/_C.abi3.so``) to the rebuilt files under ``directory``."""
    if not directory.is_dir():
        raise OverlayError(f"{directory}: kernel folder does not exist")
    found = {
        p.relative_to(directory).as_posix(): p
        for p in sorted(directory.rglob("*.so"))
        if p.is_file()
    }
    if not found:
        raise OverlayError(f"{directory}: holds no .so files")
    bad = [k for k in found if not k.startswith("vllm/")]
    if bad:
        raise OverlayError(f"{directory}: {bad[0]!r} is not under vllm/ (lay files out as in the wheel)")
    return found
