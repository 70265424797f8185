"""``make image-smoke`` without an engine: the expected lines come from the patch files, the in-image
script (scripts/image-smoke.py) catches each fault it is for, the label/entrypoint/serve checks
judge what an engine reports, the stand-in's requirements follow the pinned wheel, and the negative
case leaves a patch out. The smoke itself (an engine, minutes) runs in `make image-smoke`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlay.build.series import Series
from overlay.image.smoke import (
    CPU_ENV,
    ENTRYPOINT,
    NO_MODEL,
    Expected,
    _without_last_patch,
    check_config,
    check_serve,
    expected_lines,
    smoke,
)
from overlay.image.standin import (
    PYTHON,
    StandinError,
    leave_out,
    pip_download_command,
    recipe_digest,
    standin_ref,
    standin_requirements,
)
from tests.wheelkit import format_patch, make_release, make_wheel

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scripts" / "image-smoke.py"
BASE = {"vllm/a.py": b"x = 1\ny = 2\n", "vllm/b.py": b"b = 1\n"}


def _series(tmp_path: Path) -> Path:
    """Two patches on vllm/a.py (the second rewrites a line the first added) and one on vllm/b.py."""
    mid = b"x = 1\nadded_by_one = True\nkept_from_one = 1\ny = 2\n"
    one = format_patch({"vllm/a.py": BASE["vllm/a.py"]}, {"vllm/a.py": mid}, "One", work=tmp_path)
    two = format_patch({"vllm/a.py": mid, "vllm/b.py": BASE["vllm/b.py"]},
                       {"vllm/a.py": mid.replace(b"added_by_one = True", b"added_by_two = False"),
                        "vllm/b.py": b"b = 1\n\n    indented_by_two()\n"}, "Two", work=tmp_path)
    wheel = make_wheel(tmp_path, dict(BASE))
    return make_release(tmp_path / "repo", wheel, patches={"one.patch": one, "two.patch": two})


def test_expected_lines_come_from_the_series(tmp_path: Path) -> None:
    series = Series.load(_series(tmp_path) / "0.28.0")
    assert expected_lines(series) == {
        "one.patch": {"vllm/a.py": ["kept_from_one = 1"]},  # 'added_by_one = True' is removed by two.patch
        "two.patch": {"vllm/a.py": ["added_by_two = False"], "vllm/b.py": ["indented_by_two()"]},
    }


def test_expected_lines_of_the_real_series_cover_every_patch() -> None:
    series = Series.load(REPO / "patches" / "0.28.0")
    got = expected_lines(series)
    assert list(got) == [p.name for p in series.patches]
    assert all(lines for files in got.values() for lines in files.values())


def test_negative_case_series_leaves_the_last_patch_out(tmp_path: Path) -> None:
    root = _series(tmp_path)
    with _without_last_patch(root, "0.28.0") as (copy, dropped):
        assert dropped == "two.patch"
        assert [p.name for p in Series.load(copy / "0.28.0").patches] == ["one.patch"]
    assert not copy.exists()
    assert [p.name for p in Series.load(root / "0.28.0").patches] == ["one.patch", "two.patch"]


def test_unknown_negative_case(tmp_path: Path) -> None:
    from overlay.image.containers import Engine
    from overlay.image.smoke import ImageSmokeError

    with pytest.raises(ImageSmokeError, match=r"^NEGATIVE 'kernel' is not one of version, patch$"):
        smoke(tmp_path, "0.28.0", engine=Engine("docker", "docker"), repo=REPO, dist=tmp_path, negative="kernel")


# --------------------------------------------------------------------------- what the engine reports

WANT = Expected("0.28.0+ovl0123456789", "0.28.0", "ovl0123456789", ("a.patch", "b.patch"),
                "localhost/vllm-overlay-standin:v0.28.0", {})
LABELS = {"org.opencontainers.image.version": "0.28.0+ovl0123456789",
          "org.opencontainers.image.base.name": "localhost/vllm-overlay-standin:v0.28.0",
          "vllm-overlay.base-version": "0.28.0", "vllm-overlay.series-tag": "ovl0123456789",
          "vllm-overlay.patches": "a.patch b.patch"}


def test_config_check() -> None:
    assert check_config({"Labels": LABELS, "Entrypoint": ["vllm", "serve"]}, WANT) == []
    got = check_config({"Labels": {**LABELS, "vllm-overlay.patches": "a.patch"}, "Entrypoint": None}, WANT)
    assert got == ["label vllm-overlay.patches is 'a.patch', expected 'a.patch b.patch'",
                   f"entrypoint is None, expected {ENTRYPOINT!r}"]


def test_serve_check() -> None:
    ok = ("(APIServer pid=1) INFO [api_utils.py:333] vLLM server version 0.28.0+ovl0123456789, "
          f"serving model {NO_MODEL}\n")
    assert check_serve(ok + "OSError: not found\n", 1, "0.28.0+ovl0123456789") == []
    base = ok.replace("0.28.0+ovl0123456789", "0.28.0")
    assert check_serve(base, 1, "0.28.0+ovl0123456789") == [
        f"`vllm serve` (entrypoint) exit 1 without 'vLLM server version 0.28.0+ovl0123456789, serving model "
        f"{NO_MODEL}': it logged '{base.strip()}'"]
    assert check_serve("RuntimeError: Failed to infer device type\n", 1, "0.28.0+ovl0123456789")[0].endswith(
        ": RuntimeError: Failed to infer device type")
    assert CPU_ENV["HF_HUB_OFFLINE"] == "1"


# --------------------------------------------------------------------------- the in-image script

GOOD_JSON = ('{"base": {"version": "0.28.0"}, "version": "0.28.0+ovl0123456789", '
             '"patches": [{"name": "a.patch", "kind": "python"}]}')


def _fake_vllm(root: Path, version: str, overlay_json: str | None, dist_infos: int = 1) -> Path:
    pkg = root / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (pkg / "layer.py").write_text("def f():\n    return 2  # patched\n")
    if overlay_json is not None:
        (pkg / "_overlay.json").write_text(overlay_json)
    for i in range(dist_infos):
        (root / f"vllm-0.28.0{'+x' * i}.dist-info").mkdir()
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text('#!/bin/sh\n[ "$VLLM_TARGET_DEVICE" = cpu ] || { echo "RuntimeError: Failed to '
                                  'infer device type" >&2; exit 1; }\necho "usage: vllm [-h] [-v] {serve,...}"\n')
    (bin_dir / "vllm").chmod(0o755)
    return root


def _smoke(site: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """The script as in the image: -S keeps this environment's site-packages (and its vLLM) out."""
    env = dict(os.environ, PYTHONPATH=str(site), PATH=f"{site / 'bin'}:{os.environ['PATH']}")
    env.pop("VLLM_TARGET_DEVICE", None)
    return subprocess.run([sys.executable, "-S", str(SMOKE), "--version", "0.28.0+ovl0123456789", "--base",
                           "0.28.0", "--tag", "ovl0123456789", *args], env=env, input=stdin,
                          capture_output=True, text=True, check=False, cwd=site)


@pytest.mark.parametrize(
    ("version", "overlay_json", "dists", "rc", "line"),
    [
        pytest.param("0.28.0+ovl0123456789", GOOD_JSON, 1, 0,
                     "smoke: ok vllm 0.28.0+ovl0123456789, 1 patch(es) (python), 1 dist-info", id="ok"),
        pytest.param("0.28.0", GOOD_JSON, 1, 1,
                     "smoke: vllm.__version__ is '0.28.0', expected '0.28.0+ovl0123456789'", id="unpatched"),
        pytest.param("0.28.0+ovl0123456789", None, 1, 1, "_overlay.json: missing (not an overlay build)",
                     id="no-manifest"),
        pytest.param("0.28.0+ovl0123456789", GOOD_JSON.replace('"0.28.0"}', '"0.27.0"}'), 1, 1,
                     "'base.version' is '0.27.0', expected '0.28.0'", id="wrong-base"),
        pytest.param("0.28.0+ovl0123456789", GOOD_JSON, 2, 1, "2 vllm distributions installed, expected 1: ",
                     id="two-dist-infos"),
        pytest.param("0.28.0+ovl0123456789", GOOD_JSON, 0, 1, "0 vllm distributions installed, expected 1: none",
                     id="no-dist-info"),
    ],
)
def test_smoke_script(tmp_path: Path, version: str, overlay_json: str | None, dists: int, rc: int,
                      line: str) -> None:
    site = _fake_vllm(tmp_path / "site", version, overlay_json, dists)
    proc = _smoke(site)
    text = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == rc
    assert len(text.splitlines()) == 1 and line in text


def test_smoke_script_every_fault_in_one_line(tmp_path: Path) -> None:
    site = _fake_vllm(tmp_path / "site", "0.28.0", None, 2)
    text = (_smoke(site).stderr).strip()
    assert text.startswith("smoke: vllm.__version__ is '0.28.0'") and text.count("; ") == 2
    assert "_overlay.json: missing" in text and "2 vllm distributions" in text


def test_smoke_script_patch_lines_and_cli(tmp_path: Path) -> None:
    site = _fake_vllm(tmp_path / "site", "0.28.0+ovl0123456789", GOOD_JSON)
    good = {"a.patch": {"vllm/layer.py": ["return 2  # patched"]}}
    proc = _smoke(site, "--expect", "-", "--cli", stdin=json.dumps(good))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(", added lines of 1 patch(es) present, `vllm --help` ok")
    bad = {"a.patch": {"vllm/layer.py": ["return 2  # patched", "return 3"]}, "b.patch": {"vllm/gone.py": ["z"]}}
    proc = _smoke(site, "--expect", "-", stdin=json.dumps(bad))
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("smoke: a.patch: 1 of 2 added line(s) missing, first vllm/layer.py: 'return 3'; "
                                   "b.patch: 1 of 1 added line(s) missing, first vllm/gone.py (no such file)")
    (site / "bin" / "vllm").write_text("#!/bin/sh\necho 'ImportError: no module named x' >&2\nexit 1\n")
    proc = _smoke(site, "--cli")
    assert proc.stderr.strip() == "smoke: `vllm --help` exit 1: ImportError: no module named x"
    proc = _smoke(site, "--expect", str(tmp_path / "none.json"))
    assert proc.returncode == 1 and proc.stderr.startswith(f"smoke: --expect {tmp_path / 'none.json'}: ")


# --------------------------------------------------------------------------- the stand-in

def test_standin_requirements_follow_the_pinned_wheel(tmp_path: Path) -> None:
    from overlay.build.install import CPU_SKIP

    wheel = next((Path.home() / ".cache/vllm-overlay/wheels").glob("vllm-0.28.0-*.whl"), None)
    if wheel is None:
        pytest.skip("vllm 0.28.0's wheel not cached (make build fetches it)")
    reqs = standin_requirements(wheel, REPO)
    names = {r.split("=")[0].split("<")[0].split(">")[0].split("[")[0].split(";")[0].strip().lower() for r in reqs}
    assert "torch==2.13.0" in reqs and "transformers>=5.5.3" in reqs
    assert not names & (leave_out(REPO) | CPU_SKIP)
    assert "flashinfer-python" in leave_out(REPO)
    key = recipe_digest(REPO, reqs, "0" * 64)
    assert key != recipe_digest(REPO, reqs[1:], "0" * 64) != recipe_digest(REPO, reqs, "1" * 64)
    torch = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    torch.write_bytes(b"")
    assert standin_requirements(wheel, REPO, str(torch))[0] == "torch==2.13.0+cpu"
    with pytest.raises(StandinError, match=r"^--torch .*numpy-2.0.0-.*: a wheel of 'numpy', not torch$"):
        bad = tmp_path / "numpy-2.0.0-cp311-cp311-manylinux_2_28_x86_64.whl"
        bad.write_bytes(b"")
        standin_requirements(wheel, REPO, str(bad))


def test_pip_download_targets_the_standin_python(tmp_path: Path) -> None:
    cmd = pip_download_command(tmp_path / "r.txt", tmp_path / "d")
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert cmd[cmd.index("--python-version") + 1] == PYTHON and "--only-binary=:all:" in cmd
    platforms = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"]
    assert platforms[0] == "manylinux_2_5_x86_64" and platforms[-1] == "manylinux_2_36_x86_64"
    assert "--find-links" not in cmd
    assert standin_ref("0.28.0") == "localhost/vllm-overlay-standin:v0.28.0"


def test_standin_recipe_is_what_the_module_builds() -> None:
    text = (REPO / "docker" / "standin-base" / "Containerfile").read_text()
    assert "FROM scratch\nADD rootfs.tar /\nARG VLLM_WHEEL\n" in text
    assert "--no-index --find-links /tmp/wheelhouse" in text and "-r /tmp/wheelhouse/requirements.txt" in text
    assert 'ENTRYPOINT ["vllm", "serve"]' in text
