"""The main path on the default release's real vLLM wheel: build, RECORD, install, version."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from overlay.build.pins import default_version, load_pin
from overlay.build.pipeline import build, series_tag
from overlay.build.series import Series
from overlay.build.wheel import verify_record

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"
DEFAULT_VLLM = default_version(PATCHES)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(base_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(PATCHES, DEFAULT_VLLM, tmp_path_factory.mktemp("dist"), base_wheel=base_wheel).wheel


def expected_version() -> str:
    pin = load_pin(PATCHES, DEFAULT_VLLM)
    return f"{pin.version}+{series_tag(Series.load(PATCHES / DEFAULT_VLLM), pin)}"


def test_real_wheel_record_verifies(built: Path, base_wheel: Path) -> None:
    with zipfile.ZipFile(base_wheel) as zf:
        base_members = len([i for i in zf.infolist() if not i.filename.endswith("RECORD")])
    count = verify_record(built)
    assert count >= base_members + 1  # + vllm/_overlay.json (and any files the patches create)
    assert built.name == f"vllm-{expected_version()}-cp38-abi3-manylinux_2_28_x86_64.whl"


def test_real_wheel_keeps_compiled_members_byte_for_byte(built: Path, base_wheel: Path) -> None:
    with zipfile.ZipFile(base_wheel) as a, zipfile.ZipFile(built) as b:
        for name in ("vllm/_C_stable_libtorch.abi3.so", "vllm/_flashmla_C.abi3.so"):
            ia, ib = a.getinfo(name), b.getinfo(name)
            assert (ia.CRC, ia.compress_size, ia.file_size) == (ib.CRC, ib.compress_size, ib.file_size)


def test_installed_package_reports_the_overlay_version() -> None:
    """`make build` installed the patched wheel into the environment running these tests."""
    import vllm

    want = expected_version()
    assert vllm.__version__ == want
    assert importlib.metadata.version("vllm") == want
    manifest = json.loads((Path(vllm.__file__).parent / "_overlay.json").read_text())
    series = Series.load(PATCHES / DEFAULT_VLLM)
    assert [p["name"] for p in manifest["patches"]] == [p.name for p in series.patches]
    assert [p["sha256"] for p in manifest["patches"]] == [p.sha256 for p in series.patches]
    assert manifest["base"]["sha256"] == load_pin(PATCHES, DEFAULT_VLLM).sha256


def test_vllm_cli_reports_the_overlay_version() -> None:
    exe = shutil.which("vllm", path=str(Path(sys.executable).parent))
    assert exe, "the vllm console script is not installed"
    # Without a GPU, vLLM cannot infer its device unless told (VLLM_TARGET_DEVICE=cpu).
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=300, check=True, env=env)
    assert out.stdout.strip().splitlines()[-1] == expected_version()


def test_bench_build_reports_its_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from overlay.bench.build import run

    out = tmp_path / "bench.json"
    assert run(PATCHES, DEFAULT_VLLM, repeat=1, json_out=out) == 0
    doc = json.loads(out.read_text())
    assert doc["build_s_median"] > 0 and doc["copy_s_median"] > 0
    assert abs(doc["ratio"] - doc["build_s_median"] / doc["copy_s_median"]) < 0.05 * doc["ratio"] + 0.01
    assert "x the copy" in capsys.readouterr().out
