"""The overlay build on small synthetic wheels: errors, determinism, RECORD, atomicity."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from overlay.build.distdir import LOCK_NAME
from overlay.build.pipeline import build
from overlay.build.wheel import verify_record
from overlay.errors import ApplyError, KernelPatchError, SeriesError, WheelError
from tests.wheelkit import A_PY, BASE_FILES, format_patch, good_patch, make_release, make_wheel
from tests.wheelkit import changed as _changed

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def wheel(tmp_path: Path) -> Path:
    d = tmp_path / "base"
    d.mkdir()
    return make_wheel(d, BASE_FILES)


def test_build_writes_a_versioned_verifiable_wheel(tmp_path: Path, wheel: Path) -> None:
    root = make_release(tmp_path, wheel, patches={"fix-a.patch": good_patch(tmp_path)})
    res = build(root, "0.28.0", tmp_path / "dist", base_wheel=wheel)
    assert res.version.startswith("0.28.0+ovl") and res.version == f"0.28.0+{res.tag}"
    assert res.wheel.name == f"vllm-{res.version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert verify_record(res.wheel) == 9  # 4 base + new.py + _overlay.json + 3 dist-info files
    with zipfile.ZipFile(res.wheel) as zf:
        names = zf.namelist()
        assert names[-1] == f"vllm-{res.version}.dist-info/RECORD"
        assert not any(n.startswith("vllm-0.28.0.dist-info/") for n in names)
        assert f"version = '{res.version}'" in zf.read("vllm/_version.py").decode()
        assert f"Version: {res.version}\n" in zf.read(f"vllm-{res.version}.dist-info/METADATA").decode()
        assert b"line_5 = 50\n" in zf.read("vllm/a.py")
        assert zf.read("vllm/new.py") == b"NEW = True\n"
        assert zf.read("vllm/_C.abi3.so") == BASE_FILES["vllm/_C.abi3.so"]
        manifest = json.loads(zf.read("vllm/_overlay.json"))
    assert manifest["base"]["version"] == "0.28.0"
    assert manifest["version"] == res.version
    (entry,) = manifest["patches"]
    assert entry["name"] == "fix-a.patch" and entry["kind"] == "python" and entry["origin"] == "vendor"
    assert entry["subject"] == "Change line 5 and add new.py"
    assert len(entry["sha256"]) == 64


def test_wheel_library_accepts_the_record(tmp_path: Path, wheel: Path) -> None:
    """pypa/wheel's reader checks every member against RECORD as it reads."""
    from wheel.wheelfile import WheelFile

    root = make_release(tmp_path, wheel, patches={"fix-a.patch": good_patch(tmp_path)})
    res = build(root, "0.28.0", tmp_path / "dist", base_wheel=wheel)
    with WheelFile(res.wheel) as wf:
        for info in wf.infolist():
            wf.read(info.filename)


def test_untouched_members_are_copied_raw(tmp_path: Path, wheel: Path) -> None:
    root = make_release(tmp_path, wheel, patches={"fix-a.patch": good_patch(tmp_path)})
    res = build(root, "0.28.0", tmp_path / "dist", base_wheel=wheel)

    def raw(path: Path, name: str) -> bytes:
        with zipfile.ZipFile(path) as zf:
            info = zf.getinfo(name)
        with path.open("rb") as fh:
            fh.seek(info.header_offset + 26)
            n, m = int.from_bytes(fh.read(2), "little"), int.from_bytes(fh.read(2), "little")
            fh.seek(info.header_offset + 30 + n + m)
            return fh.read(info.compress_size)

    assert raw(res.wheel, "vllm/_C.abi3.so") == raw(wheel, "vllm/_C.abi3.so")


def test_two_builds_are_byte_identical_and_tag_is_deterministic(tmp_path: Path, wheel: Path) -> None:
    root = make_release(tmp_path, wheel, patches={"fix-a.patch": good_patch(tmp_path)})
    a = build(root, "0.28.0", tmp_path / "d1", base_wheel=wheel)
    b = build(root, "0.28.0", tmp_path / "d2", base_wheel=wheel)
    assert a.wheel.name == b.wheel.name and a.wheel.read_bytes() == b.wheel.read_bytes()
    other = format_patch({"vllm/a.py": A_PY}, {"vllm/a.py": _changed(A_PY, b"line_5 = 5\n", b"line_5 = 51\n")},
                         "Change line 5", work=tmp_path)
    (root / "0.28.0" / "fix-a.patch").write_bytes(other)
    c = build(root, "0.28.0", tmp_path / "d3", base_wheel=wheel)
    assert c.tag != a.tag


def _assert_nothing_written(dist: Path, before: dict[str, bytes]) -> None:
    now = {p.name: p.read_bytes() for p in dist.iterdir()} if dist.exists() else {}
    assert now == before


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(
            lambda t: format_patch({"vllm/a.py": _changed(A_PY, b"line_4 = 4\n", b"line_4 = 40\n")},
                                   {"vllm/a.py": _changed(A_PY, b"line_4 = 4\n", b"line_5 = 55\n")
                                    .replace(b"line_5 = 5\n", b"")}, "Drifted", work=t),
            r"^patch bad\.patch: vllm/a\.py: hunk #1 \(@@ -\d+,\d+ at bad\.patch:\d+\) "
            r"does not apply to vllm 0\.28\.0$",
            id="context-drifted",
        ),
        pytest.param(
            lambda t: format_patch({"vllm/gone.py": b"a\n"}, {"vllm/gone.py": b"b\n"}, "Missing file", work=t),
            r"^patch bad\.patch: vllm/gone\.py: file not in vllm 0\.28\.0$",
            id="missing-file",
        ),
        pytest.param(
            lambda t: format_patch({"vllm/a.py": A_PY},
                                   {"vllm/a.py": _changed(A_PY, b"line_5 = 5\n", b"line_5 = 50\n")},
                                   "Corrupt", work=t).replace(b"+line_5 = 50\n", b"+line_5 = 50\n!junk\n"),
            r"^patch bad\.patch: malformed patch at bad\.patch:\d+$",
            id="malformed-hunk",
        ),
        pytest.param(
            lambda t: format_patch({}, {"vllm/a.py": b"new\n"}, "Creates existing", work=t),
            r"^patch bad\.patch: vllm/a\.py: creates a file that vllm 0\.28\.0 already has$",
            id="creates-existing",
        ),
    ],
)
def test_apply_failures_name_patch_file_and_hunk(tmp_path: Path, wheel: Path, make, message: str) -> None:
    root = make_release(tmp_path, wheel, patches={"ok.patch": good_patch(tmp_path), "bad.patch": make(tmp_path)})
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "previous.whl").write_bytes(b"previous build")
    with pytest.raises(ApplyError, match=message):
        build(root, "0.28.0", dist, base_wheel=wheel)
    _assert_nothing_written(dist, {"previous.whl": b"previous build"})


def test_series_naming_missing_patch_writes_nothing(tmp_path: Path, wheel: Path) -> None:
    root = make_release(tmp_path, wheel, patches={"ok.patch": good_patch(tmp_path)},
                        order=["ok.patch", "missing.patch"])
    with pytest.raises(SeriesError, match=r"series:3: names 'missing.patch', which does not exist"):
        build(root, "0.28.0", tmp_path / "dist", base_wheel=wheel)
    assert not (tmp_path / "dist").exists()


def test_kernel_patch_is_refused_with_pointer_to_make_image(tmp_path: Path, wheel: Path) -> None:
    kpatch = format_patch({"csrc/attention/merge.cu": b"a\n"}, {"csrc/attention/merge.cu": b"b\n"},
                          "Fix a kernel", work=tmp_path)
    root = make_release(tmp_path, wheel, patches={"ok.patch": good_patch(tmp_path), "kern.patch": kpatch})
    with pytest.raises(KernelPatchError) as exc:
        build(root, "0.28.0", tmp_path / "dist", base_wheel=wheel)
    assert "patch kern.patch touches compiled sources (csrc/attention/merge.cu)" in str(exc.value)
    assert "make image" in str(exc.value)
    assert not (tmp_path / "dist").exists()


def test_kernel_patch_with_rebuilt_kernels(tmp_path: Path, wheel: Path) -> None:
    """The Python part of a kernel patch is overlaid; its compiled part comes from ``kernels``."""
    kpatch = format_patch({"csrc/attention/merge.cu": b"a\n", "vllm/a.py": A_PY},
                          {"csrc/attention/merge.cu": b"b\n",
                           "vllm/a.py": _changed(A_PY, b"line_7 = 7\n", b"line_7 = 70\n")},
                          "Fix a kernel and its caller", work=tmp_path)
    root = make_release(tmp_path, wheel, patches={"kern.patch": kpatch})
    so = tmp_path / "kernels" / "vllm" / "_C.abi3.so"
    so.parent.mkdir(parents=True)
    so.write_bytes(b"rebuilt")
    res = build(root, "0.28.0", tmp_path / "dist", base_wheel=wheel, kernels={"vllm/_C.abi3.so": so})
    with zipfile.ZipFile(res.wheel) as zf:
        assert zf.read("vllm/_C.abi3.so") == b"rebuilt"
        assert b"line_7 = 70\n" in zf.read("vllm/a.py")
        manifest = json.loads(zf.read("vllm/_overlay.json"))
    verify_record(res.wheel)
    # _overlay.json names the kernel patch and each rebuilt library with its target and digest
    assert manifest["kernels"] == {"patches": ["kern.patch"], "rebuilt": [
        {"path": "vllm/_C.abi3.so", "target": "_C", "sha256": hashlib.sha256(b"rebuilt").hexdigest()}]}
    stray = tmp_path / "kernels" / "vllm" / "_new.abi3.so"
    stray.write_bytes(b"x")
    with pytest.raises(WheelError, match=r"'vllm/_new\.abi3\.so' is not a library of vllm-0\.28\.0-"):
        build(root, "0.28.0", tmp_path / "dist2", base_wheel=wheel, kernels={"vllm/_new.abi3.so": stray})


_KILL_SCRIPT = """
import os, sys, time
from pathlib import Path
import overlay.build.pipeline as b
def hang(src, dst):
    Path(sys.argv[3]).write_text(str(src))
    time.sleep(120)
os.replace = hang
b.build(Path(sys.argv[1]), "0.28.0", Path(sys.argv[2]), base_wheel=Path(sys.argv[4]))
"""


def test_killed_build_leaves_previous_wheel_intact(tmp_path: Path, wheel: Path) -> None:
    root = make_release(tmp_path, wheel, patches={"fix-a.patch": good_patch(tmp_path)})
    dist = tmp_path / "dist"
    first = build(root, "0.28.0", dist, base_wheel=wheel)
    before = first.wheel.read_bytes()
    # A new series: the next build would replace the same wheel name? No: a new tag; make it the same
    # name by keeping the series and only killing the process after its temp file is complete.
    flag = tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(root), str(dist), str(flag), str(wheel)],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 60
    while not flag.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert flag.exists(), "the build never reached its final rename"
    tmp_file = Path(flag.read_text())
    assert tmp_file.exists() and tmp_file.stat().st_size > 0  # the temp wheel was fully written
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert first.wheel.read_bytes() == before
    assert sorted(p.name for p in dist.iterdir() if not p.name.startswith(".")) == [first.wheel.name]
    again = build(root, "0.28.0", dist, base_wheel=wheel)  # the next build cleans up the leftover
    assert again.wheel.read_bytes() == before
    assert sorted(p.name for p in dist.iterdir()) == [LOCK_NAME, first.wheel.name]
