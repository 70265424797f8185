"""Which requirements go into the CPU environment, and which wheels may not."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from overlay.install import cpu_installable, requirements


def _wheel(tmp_path: Path, requires: list[str]) -> Path:
    path = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    meta = "Metadata-Version: 2.4\nName: vllm\nVersion: 0.33.0\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires) + "\nbody\n"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("vllm-0.33.0.dist-info/METADATA", meta)
        zf.writestr("vllm/__init__.py", "")
    return path


@pytest.mark.parametrize(
    ("torch", "reason"),
    [
        pytest.param("torch==2.13.0", None, id="cpu-torch"),
        pytest.param("torch==2.14.0", "it requires torch==2.14.0, and this environment is built on CPU torch 2.13.0",
                     id="newer-torch"),
        pytest.param("torch>=2.12", None, id="range"),
    ],
)
def test_cpu_installable(tmp_path: Path, torch: str, reason: str | None) -> None:
    assert cpu_installable(_wheel(tmp_path, [torch, "numpy"])) == reason


def test_requirements_skip_cuda_only_builds_extras_and_markers(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, ["torch==2.13.0", "torchvision==0.28.0", "torchaudio==2.11.0", "torchcodec>=0.14",
                              "pandas; extra == \"bench\"", "six; python_version < \"3.0\"", "numpy"])
    assert requirements(wheel) == ["torch==2.13.0", "numpy"]
