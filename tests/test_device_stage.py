"""``make device-stage`` and ``scripts/device-run.sh``: requirements for the device, pip conflicts,
carries, manifest, and the device-side unpack run for real against tiny wheels (no network, no GPU)."""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from overlay import device as ds
from overlay.build.archive import TAR_MTIME
from overlay.cli import main
from overlay.device import staging
from overlay.errors import OverlayError
from tests import factskit
from tests.wheelkit import good_patch, make_release, make_wheel

REPO = Path(__file__).resolve().parent.parent
DEVICE_RUN = REPO / "scripts" / "device-run.sh"

# --- requirements ------------------------------------------------------------------------------

REQUIRES = [
    "regex",
    "fastapi[standard]<0.137.0,>=0.133.0",
    'llguidance<1.8.0,>=1.7.0; platform_machine == "x86_64" or platform_machine == "arm64"',
    'six>=1.16.0; python_version > "3.11"',
    'tomli; python_version < "3.11"',
    'pywin32; sys_platform == "win32"',
    'tokenspeed-mla==0.1.8; platform_system == "Linux"',
    "torch==2.13.0",
    "torchaudio==2.11.0",
    "Torchvision==0.28.0",
    "torchcodec>=0.14",
    "nvidia-cutlass-dsl[cu13]==4.6.2",
    'pandas; extra == "bench"',
    'mistral_common[audio]; extra == "audio"',
]


def test_device_requirements_markers_extras_and_torch_family() -> None:
    kept, skipped = ds.device_requirements(REQUIRES)
    assert kept == [
        "regex",
        "fastapi[standard]<0.137.0,>=0.133.0",
        "llguidance<1.8.0,>=1.7.0",
        "six>=1.16.0",
        "tokenspeed-mla==0.1.8",
        "torchcodec>=0.14",
        "nvidia-cutlass-dsl[cu13]==4.6.2",
    ]
    assert len(skipped) == len(REQUIRES) - len(kept)
    assert any(s.startswith("torch==2.13.0") and "device's own build" in s for s in skipped)
    assert any(s.startswith("Torchvision") for s in skipped)
    assert any(s.startswith("pandas") and "marker false" in s for s in skipped)


def test_not_needed_requirements_are_left_out_with_their_reason() -> None:
    kept, skipped = ds.device_requirements(REQUIRES, not_needed=ds.NOT_NEEDED)
    assert "tokenspeed-mla==0.1.8" not in kept and "torchcodec>=0.14" not in kept
    assert "nvidia-cutlass-dsl[cu13]==4.6.2" in kept and "regex" in kept
    assert any(s.startswith("tokenspeed-mla") and "not needed on the device: TokenSpeed" in s for s in skipped)
    # names are canonical (what the resolver reports), every one with a reason
    assert all(name == name.lower().replace("_", "-") and why for name, why in ds.NOT_NEEDED.items())
    assert "flashinfer-python" not in ds.NOT_NEEDED and "nvidia-cutlass-dsl" not in ds.NOT_NEEDED


def test_the_harness_requirements_are_pinned_as_in_pyproject() -> None:
    """``HARNESS_REQUIREMENTS`` (what device-stage adds for the overlay's own modules on the device) is the
    pin ``pyproject.toml`` gives each package: the pin (``httpx-sse==0.4.3``) was typed in settings, in
    pyproject.toml and in this file, and nothing said when they parted."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    listed = [*project["dependencies"], *(r for reqs in project["optional-dependencies"].values() for r in reqs)]
    pins = {(r := Requirement(text)).name: str(r.specifier) for text in listed}
    assert ds.HARNESS_REQUIREMENTS
    for text in ds.HARNESS_REQUIREMENTS:
        req = Requirement(text)
        assert pins.get(req.name) == str(req.specifier), f"{text}: pyproject.toml pins {req.name}{pins.get(req.name)}"


def test_the_device_guide_points_at_the_settings() -> None:
    """The guide's lists of what stays home (kernels, wheel members, packages) were prose copies of
    settings.py, untested; it names the settings instead, and each must be there."""
    guide = (REPO / "docs" / "device" / "README.md").read_text()
    assert "`overlay/device/settings.py`" in guide
    for name in ("KEEP_KERNELS", "OPTIONAL_KERNELS", "LEFT_OUT", "TORCH_FAMILY", "NOT_NEEDED"):
        assert f"`{name}`" in guide and getattr(ds.settings, name), name


def test_the_package_docstring_points_at_the_settings() -> None:
    """``overlay/device/__init__.py`` said what LEFT_OUT holds (the ``vllm-rs`` binary, fmha_sm100), the
    torch family's members and the carry sizes in its own words, untested; it names the settings."""
    doc = ds.__doc__ or ""
    assert "``overlay/device/settings.py``" in doc
    for name in ("LEFT_OUT", "KEEP_KERNELS", "OPTIONAL_KERNELS", "TORCH_FAMILY", "NOT_NEEDED", "CALL_LIMIT",
                 "CARRY_LIMIT"):
        assert f"``settings.{name}``" in doc and getattr(ds.settings, name), name
    items = [Path(prefix.rstrip("/")).name for prefix, _ in ds.LEFT_OUT]
    items += [Path(k).name for k in ds.KEEP_KERNELS] + sorted(ds.NOT_NEEDED)
    items += sorted(ds.settings.TORCH_FAMILY - {"torch"})  # the device's own torch is named on purpose
    items += [f"{ds.CALL_LIMIT // ds.MIB} MiB", f"{ds.CARRY_LIMIT // ds.MIB} MiB"]
    repeated = [item for item in items if item in doc]
    assert repeated == [], f"overlay/device/__init__.py repeats {repeated}: name the setting in settings.py"


def test_the_optional_kernels_are_kept_kernels() -> None:
    """OPTIONAL_KERNELS marks kernels of KEEP_KERNELS that may stay home: files.stage_vllm requires
    KEEP_KERNELS less OPTIONAL_KERNELS, and staging.torch_preflight judges only kept kernels, so a name
    in OPTIONAL_KERNELS that is not in KEEP_KERNELS would never travel and say nothing."""
    assert set(ds.OPTIONAL_KERNELS) <= set(ds.KEEP_KERNELS), set(ds.OPTIONAL_KERNELS) - set(ds.KEEP_KERNELS)
    assert all(why.strip() for why in ds.OPTIONAL_KERNELS.values())


def test_device_requirements_follow_the_target_not_this_interpreter() -> None:
    kept, _ = ds.device_requirements(['six; python_version > "3.11"'],
                                     env={**ds.DEVICE_ENV, "python_version": "3.11"})
    assert kept == []
    assert ds.device_requirements(['six; python_version > "3.11"'])[0] == ["six"]


def test_read_device_packages(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_text("Jinja2==3.1.6\ntyping_extensions==4.16.0\n# comment\n\nPyYAML==6.0.3  # x\n")
    assert ds.read_device_packages(f) == {"jinja2": "3.1.6", "typing-extensions": "4.16.0", "pyyaml": "6.0.3"}
    f.write_text("numpy>=2\n")
    with pytest.raises(ds.DeviceStageError, match=r"p.txt:1: expected name==version"):
        ds.read_device_packages(f)


def test_the_real_device_package_list_parses() -> None:
    packages = ds.read_device_packages(REPO / "scripts" / "device-packages.txt")
    assert packages["torch"] == "2.11.0" and packages["typing-extensions"] == "4.16.0"


# --- pip conflicts (recorded from pip 23.2 runs against vLLM 0.28.0's requirements) -----------

SETUPTOOLS = """\
Collecting six>=1.16.0 (from -r requirements.txt (line 38))
ERROR: Cannot install setuptools<81.0.0 and >=77.0.3 because these package versions have conflicting dependencies.

The conflict is caused by:
    The user requested setuptools<81.0.0 and >=77.0.3
    The user requested (constraint) setuptools==81.0.0+device

To fix this you could try to:
1. loosen the range of package versions you've specified
2. remove package versions to allow pip attempt to solve the dependency conflict

ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/#dealing-with-dependency-conflicts
"""

LLVMLITE = """\
INFO: pip is looking at multiple versions of numba to determine which version is compatible with other requirements.
ERROR: Cannot install -r requirements.txt (line 59) because these package versions have conflicting dependencies.

The conflict is caused by:
    numba 0.65.0 depends on llvmlite<0.48 and >=0.47.0dev0
    The user requested (constraint) llvmlite==0.50.0+device

Additionally, some packages in these conflicts have no matching distributions available for your environment:
    llvmlite

To fix this you could try to:
1. loosen the range of package versions you've specified

ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/#dealing-with-dependency-conflicts
"""

CUDA = """\
ERROR: Cannot install -r requirements.txt (line 71) and humming-kernels[cu13]==0.1.12 because these \
package versions have conflicting dependencies.

The conflict is caused by:
    humming-kernels 0.1.12 depends on cuda-bindings
    humming-kernels[cu13] 0.1.12 depends on cuda-bindings
    cuda-python 13.4.4 depends on cuda-bindings~=13.4.4
    The user requested (constraint) cuda-bindings==13.3.1+device
    cuda-python 13.3.1 depends on cuda-core~=1.0.0
    cuda-python 13.3.0 depends on cuda-core~=1.0.0
    The user requested (constraint) cuda-core==1.2.0+device

To fix this you could try to:
1. loosen the range of package versions you've specified

ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/#dealing-with-dependency-conflicts
"""

TORCH = """\
ERROR: Cannot install compressed-tensors==0.17.0 because these package versions have conflicting dependencies.

The conflict is caused by:
    compressed-tensors 0.17.0 depends on torch>=2.12
    The user requested (constraint) torch==2.11.0+device

ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/#dealing-with-dependency-conflicts
"""

NO_WHEEL = """\
Collecting outlines_core==0.2.14 (from -r requirements.txt (line 28))
ERROR: Could not find a version that satisfies the requirement outlines_core==0.2.14 (from versions: 0.1.0)
ERROR: No matching distribution found for outlines_core==0.2.14
"""


def test_parse_conflict_direct_requirement() -> None:
    c = ds.parse_conflict(SETUPTOOLS)
    assert c is not None and c.constraints == ("setuptools",)
    assert c.reason("setuptools") == "vllm requires setuptools<81.0.0 and >=77.0.3"


def test_parse_conflict_transitive() -> None:
    c = ds.parse_conflict(LLVMLITE)
    assert c is not None and c.constraints == ("llvmlite",)
    assert c.reason("llvmlite") == "numba 0.65.0 depends on llvmlite<0.48 and >=0.47.0dev0"


def test_parse_conflict_several_pins_reason_per_pin() -> None:
    c = ds.parse_conflict(CUDA)
    assert c is not None and c.constraints == ("cuda-bindings", "cuda-core")
    assert c.reason("cuda-core") == ("cuda-python 13.3.1 depends on cuda-core~=1.0.0; "
                                     "cuda-python 13.3.0 depends on cuda-core~=1.0.0")
    assert c.reason("cuda-bindings").startswith("humming-kernels 0.1.12 depends on cuda-bindings; ")


def test_parse_conflict_none_without_a_conflict_block() -> None:
    assert ds.parse_conflict(NO_WHEEL) is None
    assert "No matching distribution found for outlines_core" in ds.pip_error_tail(NO_WHEEL)


# --- the resolution loop, with a scripted pip ---------------------------------------------------

DEVICE = {"setuptools": "81.0.0", "llvmlite": "0.50.0", "cuda-bindings": "13.3.1", "cuda-core": "1.2.0",
          "torch": "2.11.0", "numpy": "2.5.2"}


def _item(name: str, version: str, url: str | None = None, digest: str | None = "ab" * 32,
          requires: Sequence[str] = (), extras: Sequence[str] = ()) -> dict:
    info: dict = {"url": url or f"https://files.example/{name}-{version}-py3-none-any.whl"}
    info["archive_info"] = {"hashes": {"sha256": digest}} if digest else {}
    item = {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}, "download_info": info}
    return {**item, "requested_extras": list(extras)} if extras else item


class ScriptedPip:
    """Answers like pip would for vLLM's requirements, depending on which device pins are present."""

    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []
        self.asked: list[list[str]] = []

    def __call__(self, requirements: Sequence[str], pins: Mapping[str, str]) -> ds.PipOutcome:
        self.calls.append(dict(pins))
        self.asked.append(list(requirements))
        if "setuptools" in pins:
            return ds.PipOutcome(False, SETUPTOOLS)
        if "llvmlite" in pins:
            return ds.PipOutcome(False, LLVMLITE)
        if "cuda-core" in pins:  # cuda-python 13.3.1 (with the device's cuda-bindings) needs cuda-core 1.0
            return ds.PipOutcome(False, CUDA)
        report = {"install": [
            _item("numba", "0.65.0"), _item("setuptools", "80.10.2"), _item("llvmlite", "0.47.0"),
            _item("cuda-core", "1.0.1"), _item("torch", "2.11.0+device", "file:///stubs/torch.whl", None),
            _item("NumPy", "2.5.2+device", "file:///stubs/numpy.whl", None),
            _item("Cuda_Python", "13.3.1"),
        ]}
        if "cuda-bindings" not in pins:
            report["install"].append(_item("cuda-bindings", "13.4.4"))
        if any(r.startswith("lm-eval") for r in requirements):  # an --extra: lm-eval and what it brings
            report["install"] += [_item("lm-eval", "0.4.13", requires=["sacrebleu>=1.5", 'tenacity; extra == "api"'],
                                        extras=["api"]),
                                  _item("sacrebleu", "2.5.1"), _item("tenacity", "9.1.2")]
        return ds.PipOutcome(True, "ok", report)


def test_resolve_drops_conflicting_pins_then_restores_the_unneeded_one() -> None:
    pip = ScriptedPip()
    res = ds.resolve(["numba==0.65.0", "setuptools<81,>=77"], DEVICE, pip)
    assert [d.name for d in res.dropped] == ["cuda-core", "llvmlite", "setuptools"]
    assert res.restored == ["cuda-bindings"]  # dropped with cuda-core, tried back alone: it fits
    assert res.rounds == 4
    assert {d.name: d.device_version for d in res.dropped}["llvmlite"] == "0.50.0"
    assert "numba 0.65.0 depends on llvmlite<0.48" in {d.name: d.reason for d in res.dropped}["llvmlite"]
    # stubs (the device's own packages) are not staged; names are canonical, sorted
    assert [(w.name, w.version) for w in res.wheels] == [
        ("cuda-core", "1.0.1"), ("cuda-python", "13.3.1"), ("llvmlite", "0.47.0"), ("numba", "0.65.0"),
        ("setuptools", "80.10.2")]
    assert pip.calls[0] == DEVICE and pip.calls[-1]["cuda-bindings"] == "13.3.1"
    assert len(pip.calls) == 4 + 2  # 4 rounds, then one restore try for each pin dropped together


def test_resolve_never_drops_the_torch_pin() -> None:
    with pytest.raises(ds.DeviceStageError, match=r"ResolutionImpossible"):
        ds.resolve(["compressed-tensors==0.17.0"], DEVICE, lambda r, p: ds.PipOutcome(False, TORCH))


def test_resolve_stops_on_a_missing_wheel() -> None:
    with pytest.raises(ds.DeviceStageError, match=r"No matching distribution found for outlines_core"):
        ds.resolve(["outlines_core==0.2.14"], DEVICE, lambda r, p: ds.PipOutcome(False, NO_WHEEL))


def test_resolve_is_bounded() -> None:
    many = {f"p{i}": "1.0" for i in range(10)}

    def conflict(reqs: Sequence[str], pins: Mapping[str, str]) -> ds.PipOutcome:
        name = sorted(pins)[0]
        return ds.PipOutcome(False, f"The conflict is caused by:\n    x 1 depends on {name}<1\n"
                                    f"    The user requested (constraint) {name}==1.0+device\n\n")

    with pytest.raises(ds.DeviceStageError, match=r"no resolution after 3 rounds"):
        ds.resolve(["x"], many, conflict, max_rounds=3)


def test_wheels_from_report_hash_forms() -> None:
    report = {"install": [_item("a", "1"), _item("b", "2", digest=None)]}
    report["install"][1]["download_info"]["archive_info"] = {"hash": "sha256=" + "cd" * 32}
    wheels = ds.wheels_from_report(report)
    assert [(w.name, w.sha256) for w in wheels] == [("a", "ab" * 32), ("b", "cd" * 32)]
    assert wheels[0].filename == "a-1-py3-none-any.whl"


def test_required_by_follows_markers_and_requested_extras() -> None:
    report = {"install": [
        _item("nvidia-cutlass-dsl", "4.6.2", extras=["cu13"], requires=[
            "nvidia-cutlass-dsl-libs-cu12==4.6.2", 'nvidia-cutlass-dsl-libs-cu13==4.6.2; extra == "cu13"',
            'nvidia-cutlass-dsl-libs-rocm; extra == "rocm"']),
        _item("mistral-common", "1.13.1", requires=['numpy<2.4,>=1.25; python_version <= "3.12"',
                                                     'numpy>=1.25; python_version > "3.12"']),
        _item("numba", "0.65.0", requires=["numpy<2.5,>=1.22"]),
        _item("fastapi", "0.136.3", requires=['uvicorn[standard]>=0.12; extra == "standard"']),
        _item("uvicorn", "0.54.0", requires=['websockets>=10.4; extra == "standard"', "h11>=0.8"]),
    ]}  # pip reports requested_extras for what was asked at the top only: fastapi[standard] -> uvicorn[standard]
    who = ds.required_by(report, ["nvidia-cutlass-dsl[cu13]==4.6.2", "numba==0.65.0", "fastapi[standard]"])
    assert who == {"fastapi": ["vllm"], "h11": ["uvicorn"], "numba": ["vllm"], "numpy": ["mistral-common", "numba"],
                   "nvidia-cutlass-dsl": ["vllm"], "nvidia-cutlass-dsl-libs-cu12": ["nvidia-cutlass-dsl"],
                   "nvidia-cutlass-dsl-libs-cu13": ["nvidia-cutlass-dsl"], "uvicorn": ["fastapi"],
                   "websockets": ["uvicorn"]}


def test_stub_wheel_and_version(tmp_path: Path) -> None:
    assert ds.stub_version("2.11.0") == "2.11.0+device"
    assert ds.stub_version("2.11.0+cu130") == "2.11.0+cu130.device"
    assert ds.is_stub("2.11.0+cu130.device") and not ds.is_stub("2.11.0+cu130") and not ds.is_stub("x!")
    path = ds.write_stub_wheel(tmp_path, "typing_extensions", "4.16.0")
    assert path.name == "typing_extensions-4.16.0+device-py3-none-any.whl"
    with zipfile.ZipFile(path) as zf:
        meta = zf.read("typing_extensions-4.16.0+device.dist-info/METADATA").decode()
    assert "Version: 4.16.0+device" in meta and "Requires-Dist" not in meta


def _pure_wheel(dest: Path, name: str, version: str, files: dict[str, bytes], requires: Sequence[str] = ()) -> Path:
    """A pure-Python wheel ``name-version-py3-none-any.whl`` holding ``files``."""
    dist = name.replace("-", "_")
    di = f"{dist}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    members = {**files, f"{di}/METADATA": meta.encode(),
               f"{di}/WHEEL": b"Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    path = dest / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in members.items():
            zf.writestr(zipfile.ZipInfo(member, (2026, 1, 1, 0, 0, 0)), data)
        zf.writestr(zipfile.ZipInfo(f"{di}/RECORD", (2026, 1, 1, 0, 0, 0)),
                    "".join(f"{m},,\n" for m in members) + f"{di}/RECORD,,\n")
    return path


def test_pip_runner_for_real_with_stubs_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real pip: a stub satisfies its requirement; a conflicting pin is dropped and the index's
    version is resolved instead; the device's dependencies are never resolved."""
    index = tmp_path / "index"
    index.mkdir()
    _pure_wheel(index, "app", "1.0", {"app.py": b""}, ["lib-a>=2", "lib-b<2", "torch>=2.10"])
    _pure_wheel(index, "lib-b", "1.5", {"lib_b.py": b""})
    _pure_wheel(index, "lib-b", "2.5", {"lib_b.py": b""})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("PIP_CONSTRAINT", "")
    work = tmp_path / "work"
    work.mkdir()
    run = ds.pip_runner(ds.Resolver(sys.executable, "this python", False), work)
    res = ds.resolve(["app==1.0"], {"lib-a": "2.1", "lib-b": "2.5", "torch": "2.11.0"}, run)
    assert [(w.name, w.version) for w in res.wheels] == [("app", "1.0"), ("lib-b", "1.5")]
    assert [(d.name, d.reason) for d in res.dropped] == [("lib-b", "app 1.0 depends on lib-b<2")]


def test_a_device_package_that_needs_a_replaced_one_is_staged_to_fit(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The real pip: vLLM 0.34.0 needs huggingface-hub>=2 and the device's transformers 5.17.0 needs <2. With
    the device's record of what its packages require, the stub of transformers says so: both pins are dropped
    and a transformers that fits is staged, each with pip's reason. Pinned as versions only, hub 2.4 was staged
    beside the device's transformers, and every engine stopped at import."""
    index = tmp_path / "index"
    index.mkdir()
    _pure_wheel(index, "app", "1.0", {"app.py": b""}, ["hub>=2", "tf<5.23,>=5.16"])
    _pure_wheel(index, "hub", "1.33", {"hub.py": b""})
    _pure_wheel(index, "hub", "2.4", {"hub.py": b""})
    _pure_wheel(index, "tf", "5.17.0", {"tf.py": b""}, ["hub<2,>=1.5"])
    _pure_wheel(index, "tf", "5.22.0", {"tf.py": b""}, ["hub<3,>=2"])
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("PIP_CONSTRAINT", "")
    device = {"hub": "1.33", "tf": "5.17.0", "torch": "2.11.0"}
    record = tmp_path / "device-requires.json"
    record.write_text(json.dumps({"format": 1, "packages": {
        "hub": {"version": "1.33", "requires": []},
        "tf": {"version": "5.17.0", "requires": ["hub<2,>=1.5", "not-on-the-device>=1"]},
        "torch": {"version": "2.11.0", "requires": []}}}))
    needs, without = ds.read_device_requires(record, device)
    assert needs == {"hub": (), "tf": ("hub<2,>=1.5",), "torch": ()} and without == []
    work = tmp_path / "work"
    work.mkdir()
    run = ds.pip_runner(ds.Resolver(sys.executable, "this python", False), work, needs=needs)
    res = ds.resolve(["app==1.0"], device, run)
    assert [(w.name, w.version) for w in res.wheels] == [("app", "1.0"), ("hub", "2.4"), ("tf", "5.22.0")]
    assert [(d.name, d.reason) for d in res.dropped] == [
        ("hub", "app 1.0 depends on hub>=2"), ("tf", "tf 5.17.0+device depends on hub<2 and >=1.5")]


def test_the_device_requires_record_refuses_bad_input_and_says_what_it_lacks(tmp_path: Path) -> None:
    record = tmp_path / "device-requires.json"
    record.write_text(json.dumps({"format": 1, "packages": {"a": {"version": "1.0", "requires": ["b>=2"]},
                                                            "b": {"version": "2.0", "requires": []}}}))
    needs, without = ds.read_device_requires(record, {"a": "1.1", "B": "2.0", "c": "3"})
    assert needs == {"b": ()} and without == ["a==1.1: recorded at 1.0", "c==3: not recorded"]
    for text in ("{not json", '{"packages": {"a": {"version": "1.0"}}}', "[]"):
        record.write_text(text)
        with pytest.raises(ds.DeviceStageError, match=rf"^{re.escape(str(record))}: not a record of "
                                                      r"scripts/device-requires\.py \("):
            ds.read_device_requires(record, {"a": "1.0"})
    record.write_text(json.dumps({"packages": {"a": {"version": "1.0", "requires": ["b >>> 2"]}}}))
    with pytest.raises(ds.DeviceStageError, match=r"device-requires\.json: a: 'b >>> 2': not a requirement"):
        ds.read_device_requires(record, {"a": "1.0"})


def test_the_recorded_device_requires_cover_the_device_packages() -> None:
    """``scripts/device-requires.json`` was recorded on the device beside its ``pip freeze``: every device
    package has its requirements there, at the frozen version."""
    device = ds.read_device_packages(REPO / "scripts" / "device-packages.txt")
    needs, without = ds.read_device_requires(REPO / "scripts" / "device-requires.json", device)
    assert without == [] and len(needs) == len(device)
    assert any(canon == "transformers" and any(r.startswith("huggingface-hub") for r in reqs)
               for canon, reqs in needs.items())


# --- carries ------------------------------------------------------------------------------------


def test_split_and_pack_respect_the_limit_and_are_deterministic() -> None:
    files = [("a", 70), ("b", 40), ("c", 30), ("d", 30), ("e", 250), ("f", 10)]
    pieces = ds.split_pieces(files, 100)
    big = [p for p in pieces if p.file == "e"]
    assert [(p.path, p.offset, p.size, p.part) for p in big] == [
        ("e.part-00", 0, 100, 0), ("e.part-01", 100, 100, 1), ("e.part-02", 200, 50, 2)]
    carries = ds.pack(pieces, 100)
    assert all(sum(p.size for p in c) <= 100 for c in carries)
    assert sorted(p.path for c in carries for p in c) == sorted(p.path for p in pieces)
    assert len(carries) == 5  # 430 bytes: the fewest bins of 100 is 5
    assert carries == ds.pack(list(reversed(pieces)), 100)
    assert [[p.path for p in c] for c in carries][:2] == [["e.part-00"], ["e.part-01"]]


def test_pack_refuses_a_piece_over_capacity() -> None:
    with pytest.raises(ds.DeviceStageError, match="do not fit"):
        ds.pack([ds.Piece("x", "x", 0, 11)], 10)


def _staged(tmp_path: Path, name: str, data: bytes, kind: str = "wheel") -> ds.StagedFile:
    src = tmp_path / "src" / name.replace("/", "_")
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_bytes(data)
    return ds.StagedFile(name, kind, src, len(data), hashlib.sha256(data).hexdigest())


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_write_carries_limit_manifest_and_reproducible(tmp_path: Path) -> None:
    rng = __import__("random").Random(1)
    files = [_staged(tmp_path, f"wheels/w{i}-1.0-py3-none-any.whl", rng.randbytes(size))
             for i, size in enumerate([9000, 30000, 5000, 12000])]
    limit = 16 * 1024
    m1 = ds.write_carries(tmp_path / "d1" / "x", "x", files, limit=limit, extra={"wheels": []})
    m2 = ds.write_carries(tmp_path / "d2" / "x", "x", list(reversed(files)), limit=limit, extra={"wheels": []})
    assert m1 == m2
    assert _tree_digest(tmp_path / "d1" / "x") == _tree_digest(tmp_path / "d2" / "x")
    root = tmp_path / "d1" / "x"
    carries = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert carries == [c["name"] for c in m1["carries"]] == [f"carry-{i:02d}" for i in range(1, len(carries) + 1)]
    for c in m1["carries"]:
        folder = root / c["name"]
        assert sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) <= limit
        assert json.loads((folder / "manifest.json").read_text()) == m1
        for piece in c["pieces"]:
            assert hashlib.sha256((folder / piece["path"]).read_bytes()).hexdigest() == piece["sha256"]
    big = next(f for f in m1["files"] if f["size"] == 30000)
    assert len(big["parts"]) == 3 and big["parts"][0].endswith(".whl.part-00")
    joined = b"".join((root / c["name"] / p["path"]).read_bytes()
                      for part in big["parts"] for c in m1["carries"] for p in c["pieces"] if p["path"] == part)
    assert hashlib.sha256(joined).hexdigest() == big["sha256"]
    assert json.loads((root / "manifest.json").read_text()) == m1


def test_device_calls_name_every_carry_in_order(tmp_path: Path) -> None:
    manifest = {"carries": [{"name": "carry-01"}, {"name": "carry-02"}]}
    text = ds.device_calls(manifest, Path(".device/engine"), "python3 -c 1")
    assert '1/2  carry [".device/engine/carry-01"]  command: bash scripts/device-run.sh .device/engine\n' in text
    assert text.splitlines()[2].endswith("bash scripts/device-run.sh .device/engine -- python3 -c 1")
    assert "30 s" in text.splitlines()[0]


# --- vLLM's tree and kernels from a tiny wheel ----------------------------------------------------

RNG_SEED = 7


def _tiny_vllm(dest: Path, version: str = "0.28.0+ovltest") -> Path:
    rng = __import__("random").Random(RNG_SEED)
    files = {k: rng.randbytes(3000) for k in ds.KEEP_KERNELS}
    files["vllm/_C_stable_libtorch.abi3.so"] = rng.randbytes(40_000)  # incompressible: split below
    files.update({
        "vllm/__init__.py": b"from vllm._version import __version__\n",
        "vllm/model.py": b"X = 1\n",
        "vllm/vllm-rs": b"\x7fELF rust",
        "vllm/third_party/fmha_sm100/kernel.py": b"",
        "vllm/third_party/fmha_sm100/k.cu": b"k",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2",
        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so": b"dg",
        "vllm/third_party/deep_gemm/__init__.py": b"",
        "vllm/_other_C.abi3.so": b"other",
        # what the release facts read (a 0.28.0-shaped tree): the staging refuses a release without them
        **{path: text.encode() for path, text in factskit.tree("0.28.0").files.items() if path != "vllm/_version.py"},
    })
    return make_wheel(dest, files, version=version)


def test_stage_vllm_tree_kernels_left_out_and_deterministic(tmp_path: Path) -> None:
    wheel = _tiny_vllm(tmp_path)
    a, left_a = ds.stage_vllm(wheel, tmp_path / "xz-a")
    b, left_b = ds.stage_vllm(wheel, tmp_path / "xz-b")
    assert [(f.path, f.sha256) for f in a] == [(f.path, f.sha256) for f in b] and left_a == left_b
    assert {f.path for f in a} == {"tree/vllm-tree.tar.xz", *(f"kernels/{k}.xz" for k in ds.KEEP_KERNELS)}
    assert [(d["path"], d["files"], d["bytes"]) for d in left_a] == [
        ("vllm/_other_C.abi3.so", 1, 5), ("vllm/third_party/deep_gemm/_C.cpython-", 1, 2),
        ("vllm/third_party/fmha_sm100/", 2, 1), ("vllm/vllm-rs", 1, 9),
        ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", 1, 3)]
    assert left_a[0]["why"] == ds.OTHER_LIBRARY and "Blackwell" in left_a[2]["why"]
    kernel = next(f for f in a if f.target == "vllm/_C_stable_libtorch.abi3.so")
    with zipfile.ZipFile(wheel) as zf:
        assert lzma.decompress(kernel.source.read_bytes()) == zf.read(kernel.target)
    tree = next(f for f in a if f.kind == "tree")
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(tree.source.read_bytes()))) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert "vllm/model.py" in names and "vllm/third_party/deep_gemm/__init__.py" in names
    assert "vllm-0.28.0+ovltest.dist-info/METADATA" in names
    assert not any(n.endswith(".so") or "fmha_sm100" in n or n.endswith("vllm-rs") for n in names)
    assert {(m.mtime, m.uid, m.gid, m.uname) for m in members} == {(TAR_MTIME, 0, 0, "")}


def test_stage_vllm_refuses_a_wheel_without_a_kept_kernel(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, {"vllm/__init__.py": b""})
    with pytest.raises(ds.DeviceStageError, match=r"lacks kernel\(s\) vllm/_C_stable_libtorch"):
        ds.stage_vllm(wheel, tmp_path / "xz")


# --- the resolution cache -------------------------------------------------------------------------


class StageRig:
    """``stage`` with a scripted pip (calls counted), fake downloads and a tiny wheel; no network."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp = tmp_path
        self.cache = tmp_path / "cache"
        self.pip = ScriptedPip()
        self.resolves = 0
        self.requires = ["numba==0.65.0", "setuptools<81,>=77"]
        self.packages = tmp_path / "device-packages.txt"
        self.write_packages(DEVICE)
        real_resolve, real_requires = staging.resolve, staging.wheel_requires_dist

        def counted(*args, **kwargs) -> ds.Resolution:
            self.resolves += 1
            return real_resolve(*args, **kwargs)

        def fake_download(wheels: Sequence[ds.ResolvedWheel], cache: Path, resolver: ds.Resolver):
            cache.mkdir(parents=True, exist_ok=True)
            staged = []
            for w in wheels:
                (cache / w.filename).write_bytes(f"{w.name}=={w.version}".encode())
                staged.append(_staged(tmp_path, f"wheels/{w.filename}", f"{w.name}=={w.version}".encode()))
            return staged

        monkeypatch.setattr(staging, "resolve", counted)
        monkeypatch.setattr(staging, "wheel_requires_dist",
                            lambda wheel: (real_requires(wheel)[0], list(self.requires)))
        monkeypatch.setattr(staging, "find_resolver",
                            lambda explicit=None: ds.Resolver(sys.executable, "scripted", True))
        monkeypatch.setattr(staging, "pip_runner",
                            lambda resolver, work, platforms=ds.PLATFORMS, wheelhouse=None, needs=None: self.pip)
        monkeypatch.setattr(staging, "download_wheels", fake_download)
        for key in ds.PIP_ENV_KEYS:
            monkeypatch.delenv(key, raising=False)

    def write_packages(self, pins: Mapping[str, str]) -> None:
        self.packages.write_text("".join(f"{k}=={v}\n" for k, v in pins.items()))

    def wheel(self, version: str) -> Path:
        folder = self.tmp / f"dist-{version}"
        folder.mkdir(exist_ok=True)
        return _tiny_vllm(folder, version)

    def stage(self, version: str = "0.28.0+a", **kwargs) -> dict:
        out = self.tmp / "out" / version
        return ds.stage(self.wheel(version), out, device_packages=self.packages, name="engine",
                        cache=self.cache, limit=256 * 1024, **kwargs).manifest

    def cache_files(self) -> list[Path]:
        return sorted((self.cache / "device-resolutions").glob("*.json"))


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StageRig:
    return StageRig(tmp_path, monkeypatch)


def test_resolution_cache_round_trip(tmp_path: Path) -> None:
    res = ds.resolve(["numba==0.65.0"], DEVICE, ScriptedPip())
    path = tmp_path / "r" / "k.json"
    ds.save_resolution(path, "k", res)
    assert ds.load_resolution(path, "k") == res
    assert ds.load_resolution(tmp_path / "none.json", "k") is None
    assert not [p for p in path.parent.iterdir() if p.name != "k.json"]  # no temporary file left


def test_resolution_key_covers_what_the_resolution_depends_on() -> None:
    resolver = ds.Resolver("python3.12", "CPython 3.12.3, pip 24.0", True)
    key = ds.resolution_key(["a>=1", "b"], {"x": "1.0", "y": "2.0"}, resolver)
    assert len(key) == 64
    assert key == ds.resolution_key(["a>=1", "b"], {"y": "2.0", "X": "1.0"}, resolver)  # order, case of names
    others = {
        ds.resolution_key(["a>=2", "b"], {"x": "1.0", "y": "2.0"}, resolver),
        ds.resolution_key(["a>=1", "b"], {"x": "1.1", "y": "2.0"}, resolver),
        ds.resolution_key(["a>=1", "b"], {"x": "1.0"}, resolver),
        ds.resolution_key(["a>=1", "b"], {"x": "1.0", "y": "2.0"}, resolver, platforms=("any",)),
        ds.resolution_key(["a>=1", "b"], {"x": "1.0", "y": "2.0"}, resolver, max_rounds=3),
        ds.resolution_key(["a>=1", "b"], {"x": "1.0", "y": "2.0"}, resolver, restore=False),
        ds.resolution_key(["a>=1", "b"], {"x": "1.0", "y": "2.0"}, ds.Resolver("python3", "CPython 3.11.9", False)),
    }
    assert key not in others and len(others) == 7


def test_stage_records_the_release_facts_and_refuses_a_release_without_them(
        rig: StageRig, capsys: pytest.CaptureFixture[str]) -> None:
    """The manifest carries the release facts the device's engine check will pick its cases by; a wheel whose
    release they cannot describe stops before anything is resolved, in one line naming what is missing."""
    manifest = rig.stage("0.28.0+a")
    assert manifest["release_facts"] == factskit.facts("0.28.0").to_dict()
    assert "release facts: GLM-5's model class: " in capsys.readouterr().err
    bare = rig.tmp / "bare"
    bare.mkdir()
    wheel = make_wheel(bare, {"vllm/__init__.py": b""}, version="0.35.0")
    with pytest.raises(ds.DeviceStageError) as err:
        ds.stage(wheel, rig.tmp / "out-bare", device_packages=rig.packages, name="engine", cache=rig.cache)
    assert str(err.value).startswith(f"device-stage: {wheel}: vllm 0.35.0: the release facts cannot describe it: "
                                     "GLM-5's path: vllm/model_executor/models/registry.py: not in the tree; ")
    assert "\n" not in str(err.value) and rig.resolves == 1 and not (rig.tmp / "out-bare").exists()


def test_stage_reuses_the_resolution_after_a_patch_edit(rig: StageRig, capsys: pytest.CaptureFixture[str]) -> None:
    first = rig.stage("0.28.0+a")
    assert rig.resolves == 1 and len(rig.pip.calls) == 6
    assert "resolution reused" not in capsys.readouterr().err
    second = rig.stage("0.28.0+b")  # a patch edit: another wheel, the same Requires-Dist
    err = capsys.readouterr().err
    assert rig.resolves == 1 and len(rig.pip.calls) == 6
    key = first["resolution"]["cache_key"]
    [cached] = rig.cache_files()
    assert cached.name == f"{key}.json"
    assert f"resolution reused from the cache (key {key[:16]}): {cached}" in err
    assert first["vllm"]["version"] != second["vllm"]["version"]
    assert second["wheels"] == first["wheels"] and [w["name"] for w in first["wheels"]] == [
        "cuda-core", "cuda-python", "llvmlite", "numba", "setuptools"]
    assert (first["resolution"]["cached"], second["resolution"]["cached"]) == (False, True)
    assert second["resolution"]["cache_key"] == key
    strip = ("cached",)
    assert ({k: v for k, v in first["resolution"].items() if k not in strip}
            == {k: v for k, v in second["resolution"].items() if k not in strip})


def test_stage_resolves_an_unserved_pin_at_its_stand_in(rig: StageRig, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM 0.34.0 pins flashinfer-python==0.7.3, which PyPI never served: the device resolution asks for the
    stand-in the rebase's test environments use (``overlay/build/stand_ins.py``), says so, and the manifest
    records the swap with its evidence, so a run on the device is known to be a run with the stand-in."""
    rig.requires = [*rig.requires, "flashinfer-python==0.7.3"]
    manifest = rig.stage()
    assert all("flashinfer-python==0.7.4" in asked and "flashinfer-python==0.7.3" not in asked
               for asked in rig.pip.asked)
    [line] = manifest["resolution"]["stand_ins"]
    assert line.startswith("flashinfer-python==0.7.3 resolved as flashinfer-python==0.7.4 "
                           "(overlay/build/stand_ins.py:VERSION_STAND_INS: vLLM 0.34.0 requires")
    assert f"stand-in: {line}" in capsys.readouterr().err
    assert "stand_ins" not in (rig.requires.pop(), rig.stage())[1]["resolution"]


def test_stage_resolves_again_when_a_pin_or_a_requirement_changes(rig: StageRig) -> None:
    keys = [rig.stage()["resolution"]["cache_key"]]
    rig.write_packages({**DEVICE, "numpy": "2.5.3"})
    keys.append(rig.stage()["resolution"]["cache_key"])
    assert rig.resolves == 2
    rig.requires = [*rig.requires, "regex"]
    manifest = rig.stage()
    keys.append(manifest["resolution"]["cache_key"])
    assert rig.resolves == 3 and manifest["resolution"]["cached"] is False
    assert len(set(keys)) == 3 and [p.stem for p in rig.cache_files()] == sorted(keys)
    assert rig.stage()["resolution"]["cached"] is True and rig.resolves == 3


@pytest.mark.parametrize("garbage", ["{not json", '{"format": 1, "key": "KEY", "wheels": [{"name": "x"}], '
                                                 '"dropped": [], "rounds": 1, "restored": [], "required_by": {}}'])
def test_stage_ignores_a_corrupt_cached_resolution(rig: StageRig, capsys: pytest.CaptureFixture[str],
                                                   garbage: str) -> None:
    first = rig.stage()
    [cached] = rig.cache_files()
    cached.write_text(garbage.replace("KEY", cached.stem))
    capsys.readouterr()
    again = rig.stage()
    err = capsys.readouterr().err
    assert rig.resolves == 2 and again["resolution"]["cached"] is False
    assert f"warning: cached resolution {cached} unreadable" in err and "resolving again" in err
    assert again["wheels"] == first["wheels"]
    assert ds.load_resolution(cached, cached.stem) is not None  # overwritten by the fresh resolution
    assert rig.stage()["resolution"]["cached"] is True and rig.resolves == 2


def test_no_resolution_cache_forces_a_resolve(rig: StageRig, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    rig.stage()
    assert rig.stage(resolution_cache=False)["resolution"]["cached"] is False and rig.resolves == 2
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(rig.cache))
    args = ["device-stage", "--wheel", str(rig.wheel("0.28.0+c")), "--dest", str(rig.tmp / "cli"),
            "--device-packages", str(rig.packages), "--no-device-requires"]
    # the CLI always stages the harness's own requirements (httpx-sse): one more resolution, then cached
    assert main(args) == 0 and rig.resolves == 3
    assert main(args) == 0 and rig.resolves == 3
    assert "resolution with the extras reused" in capsys.readouterr().err
    assert main([*args, "--no-resolution-cache"]) == 0 and rig.resolves == 5  # vLLM's, then with the extras
    assert "resolution cache not used (--no-resolution-cache)" in capsys.readouterr().err
    manifest = json.loads((rig.tmp / "cli" / "engine" / "manifest.json").read_text())
    assert manifest["resolution"]["cached"] is False
    assert manifest["resolution"]["extra_requirements"] == list(ds.HARNESS_REQUIREMENTS)


# --- extra requirements (--extra / EXTRA) ----------------------------------------------------------

LM_EVAL = "lm-eval[api]==0.4.13"


def test_extra_requirement_joins_vllms_resolution_and_changes_the_key(rig: StageRig) -> None:
    plain = rig.stage()
    assert "extra_requirements" not in plain["resolution"] and all(len(a) == 2 for a in rig.pip.asked)
    calls = len(rig.pip.calls)
    extra = rig.stage(extras=[LM_EVAL, 'pywin32; sys_platform == "win32"'])
    # vLLM's own resolution came from the cache; one more pip round, with both sets of requirements
    assert rig.resolves == 2 and len(rig.pip.calls) == calls + 1
    assert rig.pip.asked[-1] == [*rig.requires, LM_EVAL]
    # vLLM's dropped pins stay dropped, the other device pins stay
    assert sorted(rig.pip.calls[-1]) == ["cuda-bindings", "numpy", "torch"]
    res = extra["resolution"]
    assert res["extra_requirements"] == [LM_EVAL] and res["requirements"] == plain["resolution"]["requirements"]
    assert any(s.startswith("pywin32") and "(--extra)" in s for s in res["not_requested"])
    assert res["cache_key"] != plain["resolution"]["cache_key"] and res["cached"] is False
    assert res["dropped_device_pins"] == plain["resolution"]["dropped_device_pins"]
    who = {w["name"]: w["required_by"] for w in extra["wheels"]}
    assert who["lm-eval"] == ["extra"] and who["tenacity"] == ["lm-eval"] and who["numba"] == ["vllm"]
    assert [w["name"] for w in extra["wheels"]] == sorted([*(w["name"] for w in plain["wheels"]),
                                                           "lm-eval", "sacrebleu", "tenacity"])
    # the key covers the extras: the same extras hit the cache, other extras (or none) do not mix
    assert rig.stage(extras=[LM_EVAL])["resolution"]["cached"] is True and rig.resolves == 2
    assert rig.stage()["resolution"] == {**plain["resolution"], "cached": True}
    assert len(rig.cache_files()) == 2
    resolver = ds.Resolver("python3.12", "CPython 3.12.3, pip 24.0", True)
    keys = {ds.resolution_key(["a"], {}, resolver, extra_requirements=e) for e in ([], ["b"], ["b[x]"], ["c"])}
    assert len(keys) == 4 and ds.resolution_key(["a"], {}, resolver) in keys


def test_extra_requirement_never_stages_an_older_device_package(rig: StageRig) -> None:
    base = rig.pip

    def pip(requirements: Sequence[str], pins: Mapping[str, str]) -> ds.PipOutcome:
        if "old-numpy-user" in requirements and "numpy" in pins:
            return ds.PipOutcome(False, "The conflict is caused by:\n    old-numpy-user 1.0 depends on numpy<2.5\n"
                                        "    The user requested (constraint) numpy==2.5.2+device\n\n")
        outcome = base(requirements, pins)
        if outcome.ok and "numpy" not in pins:
            outcome.report["install"].append(_item("numpy", "2.4.4"))
        return outcome

    rig.pip = pip
    with pytest.raises(ds.DeviceStageError, match=r"need numpy==2.4.4, older than the device's 2.5.2 "
                                                  r"\(old-numpy-user 1.0 depends on numpy<2.5\)"):
        rig.stage(extras=["old-numpy-user"])
    with pytest.raises(ds.DeviceStageError, match=r"the device's own torch is used"):
        rig.stage(extras=["torch==2.13.0"])


def test_extra_with_a_missing_wheel_and_no_sdist_is_one_line(rig: StageRig, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    base = rig.pip
    no_wheel = ("Collecting rouge-score (from lm-eval[api]==0.4.13)\n"
                "ERROR: Could not find a version that satisfies the requirement rouge-score (from versions: none)\n"
                "ERROR: No matching distribution found for rouge-score\n")
    rig.pip = lambda reqs, pins: ds.PipOutcome(False, no_wheel) if LM_EVAL in reqs else base(reqs, pins)
    (tmp_path / "empty-index").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the real pip wheel, offline: it finds no sdist
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty-index"))
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(rig.cache))
    args = ["device-stage", "--wheel", str(rig.wheel("0.28.0+c")), "--dest", str(tmp_path / "cli"),
            "--device-packages", str(rig.packages), "--no-device-requires", "--extra", LM_EVAL]
    capsys.readouterr()
    assert main(args) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [err.splitlines()[-1]] and errors[0].startswith(
        "error: rouge-score: no wheel for CPython 3.12 manylinux x86_64 and no sdist to build one from (rouge-score): ")
    assert "No matching distribution found for rouge-score" in errors[0]
    assert not (tmp_path / "cli" / "engine").exists()  # nothing staged, no resolution with the extra cached
    assert len(rig.cache_files()) == 1


def test_a_version_that_does_not_exist_is_said_not_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25 item 14: ``EXTRA='lm-eval[api]==99.0'`` ended in "no wheel ... and no sdist to build one
    from"; the fault is that 99.0 does not exist, and that is what is said (real pip, offline index)."""
    index = tmp_path / "index"
    index.mkdir()
    _sdist(index, "lm-eval", "0.4.13", "py3-none-any")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    build = ds.sdist_builder(ds.Resolver(sys.executable, "this", True), tmp_path / "wheelhouse")
    with pytest.raises(ds.DeviceStageError) as exc:
        build("lm-eval[api]==99.0")
    assert str(exc.value) == ("lm-eval[api]==99.0: no such version: none of the 1 pip finds (0.4.13 to 0.4.13) "
                              "matches; ask for one of them")
    assert not list((tmp_path / "wheelhouse").glob("*.whl"))
    none = "ERROR: Could not find a version that satisfies the requirement x==1 (from versions: none)\n"
    assert ds.no_such_version(none, "x==1") is None  # nothing found at all: no sdist, said as before


def _sdist(index: Path, name: str, version: str, tag: str) -> Path:
    """An sdist whose in-tree PEP 517 backend (no build requirements) writes a wheel tagged ``tag``."""
    base = f"{name}-{version}"
    dist = name.replace("-", "_")
    di = f"{dist}-{version}.dist-info"
    backend = f"""
import zipfile
NAME = {base!r}
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    fn = "{dist}-{version}-{tag}.whl"
    files = {{"{dist}.py": "X = 1\\n", "{di}/METADATA": "Metadata-Version: 2.1\\nName: {name}\\nVersion: {version}\\n",
             "{di}/WHEEL": "Wheel-Version: 1.0\\nGenerator: t\\nRoot-Is-Purelib: true\\nTag: {tag}\\n"}}
    with zipfile.ZipFile(wheel_directory + "/" + fn, "w") as zf:
        for k, v in files.items():
            zf.writestr(k, v)
        zf.writestr("{di}/RECORD", "".join(k + ",,\\n" for k in files) + "{di}/RECORD,,\\n")
    return fn
"""
    members = {"pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
               "backend.py": backend,
               "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"}
    path = index / f"{dist}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for member, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{base}/{member}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_sdist_builder_builds_pure_python_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = tmp_path / "index"
    index.mkdir()
    _sdist(index, "rouge-score", "0.1.2", "py3-none-any")
    _sdist(index, "fastext", "1.0", "cp312-cp312-linux_x86_64")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    wheelhouse = tmp_path / "from-sdist"
    build = ds.sdist_builder(ds.Resolver(sys.executable, "this python", False), wheelhouse)
    assert build("rouge-score>=0.0.4") == "rouge_score-0.1.2-py3-none-any.whl"
    assert [p.name for p in wheelhouse.iterdir()] == ["rouge_score-0.1.2-py3-none-any.whl"]
    with pytest.raises(ds.DeviceStageError, match=r"^fastext: no wheel for the device, and its sdist builds "
                                                  r"fastext-1.0-cp312-cp312-linux_x86_64.whl, not pure Python"):
        build("fastext")
    with pytest.raises(ds.DeviceStageError, match=r"^nothere: no wheel for CPython 3.12 manylinux x86_64 and "
                                                  r"no sdist to build one from \(nothere==1\): .*No matching"):
        build("nothere==1")
    assert [p.name for p in wheelhouse.iterdir()] == ["rouge_score-0.1.2-py3-none-any.whl"]
    assert ds.is_pure_wheel("a-1-py2.py3-none-any.whl") and not ds.is_pure_wheel("a-1-cp312-abi3-any.whl")


def test_summary_names_wheels_built_from_sdists() -> None:
    manifest = {"carries": [], "wheels": [], "resolution": {"dropped_device_pins": []}}
    assert "sdist" not in ds.format_summary(manifest)
    manifest["resolution"]["built_from_sdist"] = {"word2number": "word2number-1.1-py3-none-any.whl"}
    assert ds.format_summary(manifest).endswith(
        "built from its sdist (pure Python): word2number: word2number-1.1-py3-none-any.whl")


def test_resolve_builds_a_missing_wheel_once_then_finds_it() -> None:
    built: list[str] = []
    outputs = iter([ds.PipOutcome(False, NO_WHEEL), ds.PipOutcome(True, "ok", {"install": [_item("x", "1")]})])
    res = ds.resolve(["outlines_core==0.2.14"], DEVICE, lambda r, p: next(outputs),
                     build=lambda req: built.append(req) or "outlines_core-0.2.14-py3-none-any.whl")
    assert built == ["outlines_core==0.2.14"]
    assert res.built == {"outlines-core": "outlines_core-0.2.14-py3-none-any.whl"}
    with pytest.raises(ds.DeviceStageError, match=r"^outlines-core: pip finds no wheel for the device even after"):
        ds.resolve(["outlines_core==0.2.14"], DEVICE, lambda r, p: ds.PipOutcome(False, NO_WHEEL),
                   build=lambda req: "outlines_core-0.2.14-py3-none-any.whl")


# --- the device side, for real --------------------------------------------------------------------


@pytest.fixture
def staged(tmp_path: Path) -> tuple[Path, dict]:
    """A DEST with carries of a tiny vLLM and four tiny wheels (two share the nvidia/ namespace, one has a .pth)."""
    wheels_dir = tmp_path / "whl"
    wheels_dir.mkdir()
    wheels = [
        _pure_wheel(wheels_dir, "tinypkg", "1.0", {"tinypkg/__init__.py": b"VALUE = 42\n"}),
        _pure_wheel(wheels_dir, "nvidia-fake-a", "1.0", {"nvidia/fake_a/__init__.py": b"A = 1\n"}),
        _pure_wheel(wheels_dir, "nvidia-fake-b", "1.0", {"nvidia/fake_b/__init__.py": b"B = 2\n"}),
        # nvidia-cutlass-dsl's way: a .pth that puts a folder inside the package on sys.path
        _pure_wheel(wheels_dir, "dslfake", "1.0", {
            "dslfake/__init__.py": b"",
            "dslfake/dsl_packages/cutefake/__init__.py": b"C = 3\n",
            "dslfake_packages.pth": b"import sys, os, dslfake; "
                                    b"sys.path.insert(0, os.path.join(dslfake.__path__[0], 'dsl_packages'))\n"}),
    ]
    files, _ = ds.stage_vllm(_tiny_vllm(tmp_path), tmp_path / "xz")
    files += [ds.StagedFile(f"wheels/{w.name}", "wheel", w, w.stat().st_size,
                            hashlib.sha256(w.read_bytes()).hexdigest()) for w in wheels]
    dest = tmp_path / "out" / "engine"
    manifest = ds.write_carries(dest, "engine", files, limit=32 * 1024)
    return dest, manifest


def _device_run(tmp_path: Path, dest: Path, carries: Sequence[str], *command: str) -> subprocess.CompletedProcess:
    """One device call: a fresh checkout holding only ``carries`` of ``dest``."""
    call = tmp_path / f"call-{len(list(tmp_path.glob('call-*')))}"
    for name in carries:
        shutil.copytree(dest / name, call / "engine" / name)
    (call / "engine").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OVERLAY_DEVICE_SITE": str(tmp_path / "site"), "OVERLAY_DEVICE_STAGE": str(tmp_path / "stage"),
           "OVERLAY_DEVICE_PYTHON": sys.executable, "PYTHONPATH": "", "PIP_FIND_LINKS": "", "PIP_CONSTRAINT": ""}
    args = ["bash", str(DEVICE_RUN), str(call / "engine"), *(["--", *command] if command else [])]
    return subprocess.run(args, capture_output=True, text=True, env=env, check=False, timeout=300)


PROBE = ("import os, tinypkg, nvidia.fake_a, nvidia.fake_b, vllm.model, cutefake; "
         "print(tinypkg.__file__); print(tinypkg.VALUE, nvidia.fake_a.A, nvidia.fake_b.B, vllm.model.X, cutefake.C); "
         "print(os.environ['NCCL_NVLS_ENABLE'], os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST'], "
         "os.environ['NVSHMEM_DISABLE_NVLS'])")


def test_device_run_in_several_calls(staged: tuple[Path, dict], tmp_path: Path) -> None:
    dest, manifest = staged
    names = [c["name"] for c in manifest["carries"]]
    assert len(names) >= 3
    assert any("parts" in f for f in manifest["files"])
    site = tmp_path / "site"

    first = _device_run(tmp_path, dest, names[:1], sys.executable, "-c", PROBE)
    assert first.returncode == 3, first.stderr
    assert f"carries missing: {' '.join(names[1:])}" in first.stderr
    assert not (site / "tinypkg").exists()

    middle = _device_run(tmp_path, dest, names[1:-1])  # no command: unpack only
    assert middle.returncode == 0, middle.stderr
    assert f"still to carry: {names[-1]}" in middle.stderr and not (tmp_path / "stage" / "installed").exists()

    again = _device_run(tmp_path, dest, names[:1])  # carry-01 again: nothing undone, nothing redone
    assert again.returncode == 0 and "unpacked" not in again.stderr

    last = _device_run(tmp_path, dest, names[-1:], sys.executable, "-c", PROBE)
    assert last.returncode == 0, last.stderr
    out = last.stdout.splitlines()
    assert out[0] == str(site / "tinypkg" / "__init__.py")
    assert out[1:] == ["42 1 2 1 3", "0 1 1"]
    assert last.stderr.count("installed 4 wheel(s)") == 1
    with zipfile.ZipFile(next(tmp_path.glob("vllm-*.whl"))) as zf:
        for kernel in ds.KEEP_KERNELS:
            assert (site / kernel).read_bytes() == zf.read(kernel)
    assert (site / "vllm-0.28.0+ovltest.dist-info" / "METADATA").is_file()
    assert not (site / "vllm" / "vllm-rs").exists()
    assert not list((tmp_path / "stage" / "parts").iterdir())

    later = _device_run(tmp_path, dest, [], sys.executable, "-c", PROBE)  # nothing carried: runs again
    assert later.returncode == 0, later.stderr
    assert "installed" not in later.stderr and later.stdout == last.stdout


def test_device_run_refuses_a_corrupted_piece(staged: tuple[Path, dict], tmp_path: Path) -> None:
    dest, manifest = staged
    carry = manifest["carries"][0]
    victim = dest / carry["name"] / carry["pieces"][0]["path"]
    victim.write_bytes(b"x" + victim.read_bytes()[1:])
    proc = _device_run(tmp_path, dest, [carry["name"]])
    assert proc.returncode == 1
    assert "sha256 differs from the manifest" in proc.stderr


def test_device_run_without_anything_staged(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    proc = _device_run(tmp_path, tmp_path / "empty", [], "true")
    assert proc.returncode == 1 and "nothing staged" in proc.stderr


# --- CLI ------------------------------------------------------------------------------------------


def test_cli_device_stage_names_a_missing_wheel(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["device-stage", "--wheel", str(tmp_path / "nope.whl"), "--dest", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1 and err == f"error: {tmp_path / 'nope.whl'}: no such wheel (make build writes it)\n"


def test_built_wheel_asks_for_make_build(tmp_path: Path) -> None:
    from overlay.build.pipeline import series_wheel

    base = make_wheel(tmp_path, {"vllm/__init__.py": b""})
    patches = make_release(tmp_path, base, patches={"fix-a.patch": good_patch(tmp_path)})  # an empty one is refused
    with pytest.raises(ds.DeviceStageError, match=r"run `make build VLLM=0.28.0` first"):
        ds.built_wheel(series_wheel(patches, "0.28.0"), tmp_path / "dist")


def test_harness_requirements_are_pinned_as_in_pyproject() -> None:
    """What overlay.bench.engine and overlay.regress import on the device is staged at our own pins."""
    import tomllib

    from overlay.device import HARNESS_REQUIREMENTS

    doc = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    pinned = {r.split(";")[0].strip() for group in doc["project"]["optional-dependencies"].values() for r in group}
    assert set(HARNESS_REQUIREMENTS) <= pinned


def test_carry_limit_leaves_room_for_the_checkout(tmp_path: Path) -> None:
    from overlay.device import MIB, DeviceStageError, carry_limit
    from overlay.git import git, init_repo

    init_repo(tmp_path)
    (tmp_path / "small.txt").write_bytes(b"x" * MIB)
    assert carry_limit(tmp_path) == 60 * MIB  # 1 MiB checkout: the default fits
    (tmp_path / "big.json").write_bytes(b"x" * 5 * MIB)  # untracked, not ignored: copied too
    assert carry_limit(tmp_path) == 64 * MIB - 6 * MIB - MIB
    (tmp_path / ".gitignore").write_text("big.json\n")
    git(["add", ".gitignore"], tmp_path)
    assert carry_limit(tmp_path) == 60 * MIB  # ignored files stay here
    (tmp_path / "huge.bin").write_bytes(b"x" * 60 * MIB)
    with pytest.raises(DeviceStageError, match="move large files out of git"):
        carry_limit(tmp_path)


@pytest.mark.parametrize("sub", ["", "device-wheels", "device-resolutions", "device-xz"])
def test_a_cache_folder_that_is_a_file_stops_the_staging_first(rig: StageRig, sub: str) -> None:
    """Issue 25 item 7 (and the smaller one: ``device-resolutions`` a file made every run resolve again
    without a word): ``VLLM_OVERLAY_CACHE`` or a folder in it that is a file is one line, before resolving."""
    rig.cache.mkdir(parents=True, exist_ok=True)
    if sub:
        (rig.cache / sub).write_text("x")
    else:
        rig.cache.rmdir()
        rig.cache.write_text("x")
    with pytest.raises(OverlayError) as exc:
        rig.stage()
    assert exc.value.exit_code == 2 and rig.resolves == 0
    msg = str(exc.value)
    assert msg.startswith("device-stage cache folder (VLLM_OVERLAY_CACHE) ") and "is a file" in msg, msg


# --- the liveness lines beside the manifest (engine-check --coverage on the device) -------------------

LIVENESS = b'{"format": 1, "lines": {}}\n'


def test_the_liveness_lines_travel_in_every_carry(rig: StageRig) -> None:
    dest = rig.tmp / "out" / "small"
    manifest = ds.stage(rig.wheel("0.28.0+a"), dest, device_packages=rig.packages, name="engine", cache=rig.cache,
                        limit=48 * 1024, beside={"liveness.json": LIVENESS}).manifest
    folders = sorted(dest.glob("carry-*"))
    assert len(folders) == len(manifest["carries"]) >= 2
    assert all((f / "liveness.json").read_bytes() == LIVENESS for f in folders)
    assert (dest / "liveness.json").read_bytes() == LIVENESS
    assert manifest["beside"] == {"liveness.json": {"sha256": hashlib.sha256(LIVENESS).hexdigest(),
                                                    "size": len(LIVENESS)}}
    assert all(sum(p.stat().st_size for p in f.rglob("*") if p.is_file()) <= 48 * 1024 for f in folders)
    assert "beside the manifest in every carry: liveness.json" in ds.format_summary(manifest)
    assert "beside" not in rig.stage("0.28.0+b")  # none given: the manifest as before


def test_device_run_keeps_the_liveness_lines_for_engine_check(tmp_path: Path) -> None:
    files, _ = ds.stage_vllm(_tiny_vllm(tmp_path), tmp_path / "xz")
    dest = tmp_path / "out" / "engine"
    manifest = ds.write_carries(dest, "engine", files, limit=32 * 1024, beside={"liveness.json": LIVENESS})
    names = [c["name"] for c in manifest["carries"]]
    probe = "import os; print(os.environ['OVERLAY_LIVENESS']); print(open(os.environ['OVERLAY_LIVENESS']).read())"
    first = _device_run(tmp_path, dest, names[:1])
    assert first.returncode == 0, first.stderr
    last = _device_run(tmp_path, dest, names[1:], sys.executable, "-c", probe)  # a call that did not carry it
    assert last.returncode == 0, last.stderr
    assert last.stdout.splitlines()[:2] == [str(tmp_path / "stage" / "liveness.json"), LIVENESS.decode().strip()]
    (dest / names[0] / "liveness.json").write_bytes(b"{}\n")  # a corrupted copy, in a fresh staging
    shutil.rmtree(tmp_path / "stage")
    bad = _device_run(tmp_path, dest, names[:1])
    assert bad.returncode == 1 and "liveness.json: missing, or its sha256 differs from the manifest" in bad.stderr


def test_device_stage_stages_the_lines_of_the_series_own_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The real attribution of a tiny release (its base wheel in the cache, one patch), for the wheel the
    series builds only: another wheel's lines would count other statements."""
    from overlay.build.pipeline import series_wheel
    from overlay.engine.liveness_lines import staged_lines
    from tests.wheelkit import BASE_FILES

    base = make_wheel(tmp_path, BASE_FILES)
    root = make_release(tmp_path, base, patches={"fix.patch": good_patch(tmp_path)})
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    shutil.copyfile(base, cache / "wheels" / base.name)
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(cache))
    own = series_wheel(root, "0.28.0")
    beside = staged_lines(own, tmp_path / "dist" / own.filename)
    doc = json.loads(beside["liveness.json"])
    assert doc == {"format": 1, "release": "0.28.0", "vllm": own.version, "series": ["fix.patch"],
                   "lines": {"fix.patch": {"vllm/a.py": [6], "vllm/new.py": [1]}}}
    assert "liveness.json: vllm 0.28.0+ovl" in capsys.readouterr().err
    assert staged_lines(own, tmp_path / "vllm-0.28.0+ovlother-cp38-abi3-manylinux_2_28_x86_64.whl") == {}
    assert "liveness.json not staged: vllm-0.28.0+ovlother" in capsys.readouterr().err
    out = tmp_path / "lines" / "liveness.json"  # the same file without staging: overlay liveness-lines
    assert main(["--patches", str(root), "liveness-lines", "--vllm", "0.28.0", "--out", str(out)]) == 0
    assert out.read_bytes() == beside["liveness.json"]
