"""What a release's kernels need of torch against the device's torch (``overlay.device.torch_abi``) and
device-stage's preflight: one line naming what fails, a required kernel refused, an optional one home."""

from __future__ import annotations

import io
import lzma
import struct
import tarfile
from pathlib import Path

import pytest

from overlay import device as ds
from overlay.cli import main
from overlay.device import staging, torch_abi
from tests.wheelkit import make_wheel

REPO = Path(__file__).resolve().parents[1]
STABLE_OK = ["aoti_torch_empty_strided", "torch_library_impl"]


def make_elf(undefined: list[str], defined: list[str] = (), weak: list[str] = ()) -> bytes:
    """A minimal ELF64 little-endian shared object: a .dynsym of these symbols and its .dynstr."""
    names = [*undefined, *defined, *weak]
    strtab = b"\0" + b"".join(n.encode() + b"\0" for n in names)
    offsets, pos = [], 1
    for n in names:
        offsets.append(pos)
        pos += len(n) + 1
    syms = [bytes(24)]
    for i, _ in enumerate(names):
        is_weak = i >= len(undefined) + len(defined)
        shndx = 5 if len(undefined) <= i < len(undefined) + len(defined) else 0
        info = ((2 if is_weak else 1) << 4) | 2  # binding WEAK/GLOBAL, type FUNC
        syms.append(struct.pack("<IBBHQQ", offsets[i], info, 0, shndx, 0, 0))
    symtab = b"".join(syms)
    str_off = 64
    sym_off = str_off + len(strtab)
    sh_off = sym_off + len(symtab)
    header = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    header += struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, sh_off, 0, 64, 0, 0, 64, 3, 0)
    sections = [bytes(64),
                struct.pack("<IIQQQQIIQQ", 0, 11, 2, 0, sym_off, len(symtab), 2, 1, 8, 24),
                struct.pack("<IIQQQQIIQQ", 0, 3, 2, 0, str_off, len(strtab), 0, 0, 1, 0)]
    return header + strtab + symtab + b"".join(sections)


def exports(tmp_path: Path, version: str = "2.11.0", names: list[str] = STABLE_OK) -> Path:
    root = tmp_path / "exports"
    root.mkdir(exist_ok=True)
    (root / f"torch-{version}.txt").write_text("# test list\n" + "\n".join(names) + "\n")
    return root


def test_dynamic_symbols_of_a_small_elf() -> None:
    data = make_elf(["aoti_torch_a", "_ZN3c104callEv", "memcpy"], ["torch_own"], ["aoti_torch_weak"])
    undefined, defined = torch_abi.dynamic_symbols(data)
    assert undefined == {"aoti_torch_a", "_ZN3c104callEv", "memcpy"}  # the weak one may stay unresolved
    assert defined == {"torch_own"}
    assert torch_abi.dynamic_symbols(b"not an elf") is None
    assert torch_abi.dynamic_symbols(data[:80]) is None  # cut short: no sections to read


def test_kernel_needs_stable_cxx_and_none(tmp_path: Path) -> None:
    root = exports(tmp_path)
    kernels = {"vllm/a.so": make_elf([*STABLE_OK, "memcpy"]), "vllm/b.so": make_elf(["torch_new_stable_ivalue"]),
               "vllm/c.so": make_elf(["_ZNK2at10TensorBase4sizeEv"]), "vllm/d.so": make_elf(["memcpy"]),
               "vllm/fake.so": b"random bytes"}
    got = torch_abi.check("0.33.0", "2.14.0", "2.11.0", kernels, root)
    assert [(k.path, k.abi, k.stable, k.missing) for k in got.kernels] == [
        ("vllm/a.so", "stable", 2, ()), ("vllm/b.so", "stable", 1, ("torch_new_stable_ivalue",)),
        ("vllm/c.so", "c++", 0, ()), ("vllm/d.so", "none", 0, ())]
    assert [k.path for k in got.failing()] == ["vllm/b.so", "vllm/c.so"]
    line = got.line()
    assert "\n" not in line
    assert line == ("vllm 0.33.0 needs torch 2.14.0; the device has 2.11.0: vllm/b.so needs torch_new_stable_ivalue "
                    "(not exported by torch 2.11.0); vllm/c.so is built on torch's C++ ABI (torch 2.14.0 exactly)")
    home = got.line(left_out=["vllm/b.so", "vllm/c.so"])
    assert home.startswith("vllm 0.33.0 needs torch 2.14.0; the device has 2.11.0: 2 of 4 kernels resolve against "
                           "2.11.0 (1 on torch's stable ABI, 2 shim symbols; 1 without torch symbols); "
                           "left out: vllm/b.so needs")
    # the same torch: a C++ ABI kernel loads
    same = torch_abi.check("0.28.0", "2.11.0", "2.11.0", {"vllm/c.so": kernels["vllm/c.so"]}, root)
    assert not same.failing() and same.line().endswith(": the same torch")
    # no export list for the device's torch: said, nothing judged
    unknown = torch_abi.check("0.33.0", "2.14.0", "2.12.0", kernels, root)
    assert not unknown.exports and "no export list of torch 2.12.0" in unknown.line()


def test_pinned_torch() -> None:
    assert staging.pinned_torch(["numpy", "torch==2.14.0", "torchvision==0.29.0"]) == "2.14.0"
    assert staging.pinned_torch(["torch>=2.10"]) is None
    assert staging.pinned_torch(["torch==2.9.0; platform_machine == 'aarch64'"]) is None


def _kernels(undefined: dict[str, list[str]]) -> dict[str, bytes]:
    files = {k: make_elf(STABLE_OK) for k in ds.KEEP_KERNELS}
    files.update({k: make_elf(v) for k, v in undefined.items()})
    return files


def test_preflight_refuses_a_required_kernel_in_one_line(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, _kernels({"vllm/_C_stable_libtorch.abi3.so": [*STABLE_OK, "torch_new_thing"]}),
                       version="0.33.0", requires=("torch==2.14.0",))
    with pytest.raises(ds.DeviceStageError) as err:
        staging.torch_preflight(wheel, "0.33.0+ovl1", ["torch==2.14.0"], {"torch": "2.11.0"}, exports(tmp_path))
    assert str(err.value) == ("vllm 0.33.0 needs torch 2.14.0; the device has 2.11.0: vllm/_C_stable_libtorch.abi3.so "
                              "needs torch_new_thing (not exported by torch 2.11.0)")


def test_preflight_leaves_an_optional_kernel_home(tmp_path: Path) -> None:
    qutlass = "vllm/_qutlass_C.abi3.so"
    assert qutlass in ds.OPTIONAL_KERNELS
    wheel = make_wheel(tmp_path, _kernels({qutlass: ["torch_exception_get_what"]}), version="0.33.0")
    result, home = staging.torch_preflight(wheel, "0.33.0", ["torch==2.14.0"], {"torch": "2.11.0"},
                                           exports(tmp_path))
    assert list(home) == [qutlass] and "torch_exception_get_what" in home[qutlass]
    assert "contextlib.suppress(ImportError)" in home[qutlass]
    assert "left out: vllm/_qutlass_C.abi3.so needs torch_exception_get_what" in result.line(home)
    files, left_out = ds.stage_vllm(wheel, tmp_path / "xz", home=home)
    assert f"kernels/{qutlass}.xz" not in {f.path for f in files}
    assert {"path": qutlass, "files": 1, "bytes": len(make_elf(["torch_exception_get_what"])),
            "why": home[qutlass]} in left_out


def test_a_wheel_may_lack_an_optional_kernel_not_a_required_one(tmp_path: Path) -> None:
    files = _kernels({})
    del files["vllm/_rust_tool_parser.abi3.so"]  # gone in 0.33.0
    staged, _ = ds.stage_vllm(make_wheel(tmp_path, files, version="0.33.0"), tmp_path / "xz")
    assert "kernels/vllm/_rust_tool_parser.abi3.so.xz" not in {f.path for f in staged}
    del files["vllm/_flashmla_C.abi3.so"]
    (tmp_path / "b").mkdir()
    with pytest.raises(ds.DeviceStageError, match=r"lacks kernel\(s\) vllm/_flashmla_C.abi3.so$"):
        ds.stage_vllm(make_wheel(tmp_path / "b", files, version="0.33.0"), tmp_path / "xz")


def test_device_stage_says_the_line_and_stops_before_resolving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    wheel = make_wheel(tmp_path, _kernels({"vllm/_moe_C_stable_libtorch.abi3.so": ["torch_new_thing"]}),
                       version="0.33.0", requires=("torch==2.14.0",))
    packages = tmp_path / "device-packages.txt"
    packages.write_text("torch==2.11.0\nnumpy==2.5.2\n")
    monkeypatch.setattr(staging, "find_resolver", lambda *_: pytest.fail("resolved before the preflight"))
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(tmp_path / "cache"))
    rc = main(["device-stage", "--wheel", str(wheel), "--device-packages", str(packages),
               "--dest", str(tmp_path / "dest")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err[-1].endswith("vllm 0.33.0 needs torch 2.14.0; the device has 2.11.0: "
                            "vllm/_moe_C_stable_libtorch.abi3.so needs torch_new_thing (not exported by torch 2.11.0)")


def test_the_shipped_export_list_is_torch_2_11_0s() -> None:
    text = (torch_abi.EXPORTS_DIR / "torch-2.11.0.txt").read_text()
    assert "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl" in text.splitlines()[0]
    names = torch_abi.read_exports("2.11.0")
    assert len(names) == 512 and all(torch_abi.is_stable(n) for n in names)
    device = dict(ln.split("==") for ln in (REPO / "scripts" / "device-packages.txt").read_text().split()
                  if ln.startswith("torch=="))
    assert device["torch"] == "2.11.0"


@pytest.mark.slow
@pytest.mark.parametrize(("release", "pinned", "home"), [
    ("0.28.0", "2.13.0", {}),
    ("0.34.0", "2.14.0", {}),
])
def test_the_real_wheels_against_the_devices_torch(release: str, pinned: str, home: dict) -> None:
    """The measured fact (docs/records/engine/0.33.0-on-torch-2.11.md, and 0.34.0's run of 2026-12-06): every
    kernel of both carried releases that travels is on torch's stable ABI and resolves against 2.11.0 (the
    retired 0.33.0's QuTLASS did not)."""
    from overlay.build.fetch import fetch_wheel
    from overlay.build.pins import load_pin

    wheel = fetch_wheel(load_pin(REPO / "patches", release))
    _, requires = ds.wheel_requires_dist(wheel)
    result, left = staging.torch_preflight(wheel, release, requires, {"torch": "2.11.0"})
    assert result.pinned == pinned
    assert {k.path: k.missing for k in result.failing()} == home and set(left) == set(home)
    assert {k.abi for k in result.kernels} == {"stable", "none"}
    print(result.line(left))


def test_0_33_0s_deep_gemm_loader_travels_its_extension_stays(tmp_path: Path) -> None:
    """0.33.0's vendored DeepGEMM is ``_C.py`` loading ``_C_extension.abi3.so``: the Python file travels
    (0.28.0's rule for its ``_C.cpython-*.so`` files must not catch it), the extension stays home."""
    files = {**_kernels({}), "vllm/third_party/deep_gemm/_C.py": b"# loads _C_extension\n",
             "vllm/third_party/deep_gemm/_C_extension.abi3.so": make_elf(STABLE_OK)}
    staged, left_out = ds.stage_vllm(make_wheel(tmp_path, files, version="0.33.0"), tmp_path / "xz")
    assert [d["path"] for d in left_out] == ["vllm/third_party/deep_gemm/_C_extension."]
    assert "stable ABI" in left_out[0]["why"] and "stand-in" in left_out[0]["why"]
    tree = next(f for f in staged if f.kind == "tree")
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(tree.source.read_bytes()))) as tar:
        assert "vllm/third_party/deep_gemm/_C.py" in tar.getnames()
