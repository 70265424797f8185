"""Which requirements go into the CPU environment, and how a wheel goes into an environment."""

from __future__ import annotations

import csv
import importlib.util
import os
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import time
import venv
import zipfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest

from overlay.build.install import HASH_CHECK_MAX, check_torch_pin, install, requirements, torch_mismatch, torch_pin
from overlay.build.pins import default_version
from overlay.build.wheel import record_hash
from overlay.errors import OverlayError
from tests.wheelkit import make_wheel

REPO = Path(__file__).resolve().parent.parent


def _wheel(tmp_path: Path, requires: list[str]) -> Path:
    path = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    meta = "Metadata-Version: 2.4\nName: vllm\nVersion: 0.33.0\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires) + "\nbody\n"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("vllm-0.33.0.dist-info/METADATA", meta)
        zf.writestr("vllm/__init__.py", "")
    return path


@pytest.mark.parametrize(
    ("torch", "pinned"),
    [
        pytest.param("torch==2.13.0", "2.13.0", id="exact"),
        pytest.param("torch>=2.12", None, id="range"),
        pytest.param("numpy", None, id="none"),
    ],
)
def test_torch_pin(tmp_path: Path, torch: str, pinned: str | None) -> None:
    assert torch_pin(_wheel(tmp_path, [torch, "numpy"])) == pinned


def test_an_environment_holding_another_releases_torch_is_refused(tmp_path: Path) -> None:
    """One environment, one release's torch: a wheel pinning another torch than the environment holds is not
    installed there (the build says so in one line); the environment's own torch or none is fine."""
    env = tmp_path / "env"
    site = env / "lib" / "site-packages"
    (site / "torch-2.13.0+cpu.dist-info").mkdir(parents=True)
    (site / "torch-2.13.0+cpu.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\n"
                                                                   "Version: 2.13.0+cpu\n")
    (env / "bin").mkdir()
    (env / "bin" / "python").write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    (env / "bin" / "python").chmod(0o755)
    assert torch_mismatch(_wheel(tmp_path, ["torch==2.13.0"]), env) is None
    assert torch_mismatch(_wheel(tmp_path, ["torch==2.14.0"]), env) == (
        f"it pins torch==2.14.0, and {env} holds torch 2.13.0 (another release's)")
    assert torch_mismatch(_wheel(tmp_path, ["torch==2.14.0"]), tmp_path / "new") is None  # made on its torch


def test_a_pin_whose_torch_differs_from_its_wheel_is_named(tmp_path: Path) -> None:
    from overlay.errors import PinError

    wheel = _wheel(tmp_path, ["torch==2.14.0"])
    check_torch_pin("2.14.0", wheel, "patches/x/pin.toml")
    with pytest.raises(PinError) as exc:
        check_torch_pin("2.13.0", wheel, "patches/x/pin.toml")
    assert str(exc.value) == (f"patches/x/pin.toml: field 'torch' is '2.13.0', but {wheel.name} pins torch==2.14.0: "
                              'write torch = "2.14.0" there')


def test_requirements_skip_cuda_only_builds_extras_and_markers(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, ["torch==2.13.0", "torchvision==0.28.0", "torchaudio==2.11.0", "torchcodec>=0.14",
                              "pandas; extra == \"bench\"", "six; python_version < \"3.0\"", "numpy"])
    assert requirements(wheel) == ["torch==2.13.0", "numpy"]


# --- installing: incremental against pip, kills, repairs ------------------------------------------

A_FILES = {
    "vllm/__init__.py": b"from vllm._version import __version__\n",
    "vllm/a.py": b"V = 'A'\n",
    "vllm/gone.py": b"G = 1\n",
    "vllm/sub/__init__.py": b"",
    "vllm/sub/b.py": b"B = 'same'\n",
    "vllm/lib.so": b"\x7fELF-old" * 100,
    "vllm/data.bin": b"\0" * (HASH_CHECK_MAX + 10),
}
B_FILES = {**{k: v for k, v in A_FILES.items() if k != "vllm/gone.py"},
           "vllm/a.py": b"V = 'B'\n", "vllm/sub/new.py": b"N = 2\n", "vllm/lib.so": b"\x7fELF-new" * 100}
A_VERSION, B_VERSION = "0.28.0+ovlaaaaaaaaaa", "0.28.0+ovlbbbbbbbbbb"


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("wheels")
    (d / "a").mkdir()
    (d / "b").mkdir()
    exe = frozenset({"vllm/lib.so"})
    return (make_wheel(d / "a", A_FILES, A_VERSION, requires=("numpy",), executable=exe),
            make_wheel(d / "b", B_FILES, B_VERSION, requires=("numpy",), executable=exe))


@pytest.fixture(scope="session")
def env_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with pip and nothing else (copied per test: creating one takes seconds)."""
    d = tmp_path_factory.mktemp("tpl") / "env"
    venv.EnvBuilder(with_pip=True).create(d)
    return d


def _copy_env(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


@pytest.fixture(scope="session")
def env_with_a(env_template: Path, wheels: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = _copy_env(env_template, tmp_path_factory.mktemp("enva") / "env")
    assert install(wheels[0], env, with_deps=False).how == "pip"
    return env


@pytest.fixture(scope="session")
def pip_b(env_template: Path, wheels: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: wheel B installed into a fresh environment by a plain ``pip install``."""
    env = _copy_env(env_template, tmp_path_factory.mktemp("envb") / "env")
    subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-deps", str(wheels[1])], check=True)
    return env


def _site(env: Path) -> Path:
    return next((env / "lib").glob("python3*/site-packages"))


def _record_true(env: Path) -> None:
    """Every hashed RECORD row matches its file; every file of the distribution is listed."""
    site = _site(env)
    info = next(site.glob("vllm-*.dist-info"))
    rows = list(csv.reader((info / "RECORD").read_text().splitlines()))
    for path, hash_, size in rows:
        if hash_:
            data = (site / path).read_bytes()
            assert (record_hash(data), str(len(data))) == (hash_, size), path
    listed = {os.path.normpath(site / r[0]) for r in rows}
    on_disk = {str(p) for top in ("vllm", info.name) for p in (site / top).rglob("*") if p.is_file()}
    assert on_disk <= listed


def snapshot(env: Path) -> dict[str, object]:
    """The distribution as installed: files, modes, contents, RECORD (script rows by path); .pyc checked valid."""
    site = _site(env)
    out: dict[str, object] = {}
    paths = [p for p in site.iterdir() if p.name.startswith(("vllm", "~", ".overlay"))]
    for top in paths:
        for p in sorted([top, *top.rglob("*")] if top.is_dir() else [top]):
            if not p.is_file():
                continue
            rel = str(p.relative_to(site))
            data = p.read_bytes()
            if p.suffix == ".pyc":
                src = Path(cache_source(p))
                assert int.from_bytes(data[8:12], "little") == int(src.stat().st_mtime) & 0xFFFFFFFF, rel
                data = b"pyc"
            if p.name == "RECORD":
                rows = [r[:1] if r[0].startswith("../") else r for r in csv.reader(data.decode().splitlines())]
                data = repr(rows).encode()
            out[rel] = (stat.S_IMODE(p.stat().st_mode), data)
    script = env / "bin" / "vllm"
    body = script.read_bytes().split(b"\n", 1)[1]  # after the shebang (a copied environment keeps its original's)
    out["bin/vllm"] = (stat.S_IMODE(script.stat().st_mode), body)
    return out


def cache_source(pyc: Path) -> str:
    return importlib.util.source_from_cache(str(pyc))


def test_incremental_install_is_what_pip_installs(env_with_a: Path, pip_b: Path, wheels: tuple[Path, Path],
                                                  tmp_path: Path) -> None:
    env = _copy_env(env_with_a, tmp_path / "env")
    done = install(wheels[1], env, with_deps=False)
    # a.py, new.py, lib.so, _version.py, their 3 .pyc, and the 7 files of the dist-info
    assert (done.how, done.written) == ("incremental", 14)
    assert snapshot(env) == snapshot(pip_b)
    _record_true(env)
    py = str(env / "bin" / "python")
    show = subprocess.run([py, "-m", "pip", "show", "vllm"], capture_output=True, text=True, check=True).stdout
    assert f"Version: {B_VERSION}" in show
    links: list[str] = []
    real_link = os.link
    with mock.patch("overlay.build.install.os.link", side_effect=lambda s, d: links.append(d) or real_link(s, d)):
        assert install(wheels[1], env, with_deps=False).how == "unchanged"
    assert links == []  # decided before staging: nothing linked into a stage only to be dropped
    subprocess.run([py, "-m", "pip", "uninstall", "-q", "-y", "vllm"], check=True)
    assert not [p.name for p in _site(env).iterdir() if "vllm" in p.name or p.name.startswith("~")]
    assert not (env / "bin" / "vllm").exists()


def test_incremental_install_repairs_an_edited_file(env_with_a: Path, pip_b: Path, wheels: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    env = _copy_env(env_with_a, tmp_path / "env")
    (_site(env) / "vllm" / "sub" / "b.py").write_text("B = 'edited by hand'\n")
    assert install(wheels[1], env, with_deps=False).how == "incremental"
    assert snapshot(env) == snapshot(pip_b)


def _interrupted_pip(site: Path) -> None:
    """What a pip killed in ``--force-reinstall`` leaves: old dist-info stashed, a partial tree."""
    info = next(site.glob("vllm-*.dist-info"))
    info.rename(site / ("~" + info.name[1:]))
    (site / "vllm" / "sub" / "b.py").unlink()
    (site / "vllm" / "stray.py").write_text("left = True\n")


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        pytest.param(_interrupted_pip, "has no dist-info folder (an interrupted install)", id="killed-pip"),
        pytest.param(lambda site: (next(site.glob("vllm-*.dist-info")) / "RECORD").unlink(), "is not whole",
                     id="no-record"),
        pytest.param(lambda site: shutil.copytree(next(site.glob("vllm-*.dist-info")),
                                                  site / "vllm-0.27.0.dist-info"), "2 dist-info folders",
                     id="two-dist-infos"),
    ],
)
def test_broken_install_is_reinstalled_whole(env_with_a: Path, pip_b: Path, wheels: tuple[Path, Path],
                                             tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             damage: Callable[[Path], None], why: str) -> None:
    env = _copy_env(env_with_a, tmp_path / "env")
    damage(_site(env))
    done = install(wheels[1], env, with_deps=False)
    assert done.how == "pip" and why in done.reason
    assert snapshot(env) == snapshot(pip_b)


def test_changed_requirements_take_the_pip_path(env_with_a: Path, tmp_path: Path) -> None:
    env = _copy_env(env_with_a, tmp_path / "env")
    (tmp_path / "c").mkdir()
    wheel = make_wheel(tmp_path / "c", B_FILES, B_VERSION, requires=("numpy", "six"))
    done = install(wheel, env, with_deps=False)
    assert (done.how, done.reason) == ("pip", "the requirements changed")
    _record_true(env)


@pytest.mark.parametrize(
    ("make_bad", "message"),
    [
        pytest.param(lambda env: env.write_text(""), "{env}: is a file, not an environment", id="env-is-a-file"),
        pytest.param(lambda env: (_site(env) / ".overlay-install").write_text(""),
                     "{site}/.overlay-install: is not a folder: remove it and build again", id="stage-is-a-file"),
        pytest.param(lambda env: ((_site(env) / ".overlay-install").mkdir(), (_site(env) / ".overlay-install"
                                  / "plan.json").write_text("{")),
                     "{site}/.overlay-install/plan.json: unreadable install plan", id="bad-plan"),
    ],
)
def test_bad_states_are_one_line_errors(env_with_a: Path, wheels: tuple[Path, Path], tmp_path: Path,
                                        make_bad: Callable[[Path], object], message: str) -> None:
    env = tmp_path / "env"
    if "file" not in message.split(":")[1] or "stage" in message:
        _copy_env(env_with_a, env)
    make_bad(env)
    site = _site(env) if env.is_dir() else env
    with pytest.raises(OverlayError) as err:
        install(wheels[1], env, with_deps=False)
    assert str(err.value).startswith(message.format(env=env, site=site))
    assert "\n" not in str(err.value)


KILLER = r"""
import os, signal, sys
from pathlib import Path
from unittest import mock
kill_at, count = int(sys.argv[1]), 0
def wrap(mod, name):
    real = getattr(mod, name)
    def call(*args, **kwargs):
        global count
        count += 1
        if kill_at == 0:
            print(count, name, file=sys.stderr)
        if count == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    setattr(mod, name, call)
for name in ("link", "rename", "replace", "unlink", "mkdir", "rmdir", "chmod"):
    wrap(os, name)
import overlay.build.swap
wrap(overlay.build.swap, "exchange")
from overlay.build.install import install
install(Path(sys.argv[2]), Path(sys.argv[3]), with_deps=False)
print(count)
"""


def _kill_run(wheel: Path, env: Path, at: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", KILLER, str(at), str(wheel), str(env)], capture_output=True,
                          text=True, check=False, cwd=REPO)


def _tree(site: Path) -> dict[str, bytes]:
    return {str(p.relative_to(site / "vllm")): p.read_bytes() for p in (site / "vllm").rglob("*")
            if p.is_file() and p.suffix != ".pyc"}


def test_a_kill_anywhere_leaves_old_or_new_and_the_next_install_repairs(
        env_with_a: Path, pip_b: Path, wheels: tuple[Path, Path], tmp_path: Path) -> None:
    probe = _copy_env(env_with_a, tmp_path / "probe")
    probed = _kill_run(wheels[1], probe, 0)
    total = int(probed.stdout)
    calls = [line.split() for line in probed.stderr.splitlines() if line[:1].isdigit()]
    # Spread over staging, and around every rename and exchange (the commit), and into the clean-up.
    swaps = [int(n) for n, name in calls if name in ("rename", "replace", "exchange")]
    points = sorted({1, total // 4, total // 2, total} | {n + d for n in swaps for d in (0, 1)} - {total + 1})
    assert any(name == "exchange" for _, name in calls) and len(points) >= 8
    old_tree, new_tree = _tree(_site(env_with_a)), _tree(_site(pip_b))
    for at in points:
        env = _copy_env(env_with_a, tmp_path / f"env{at}")
        proc = _kill_run(wheels[1], env, at)
        assert proc.returncode == -signal.SIGKILL, (at, proc.stderr)
        tree = _tree(_site(env))
        assert tree in (old_tree, new_tree), at
        out = subprocess.run([str(env / "bin" / "python"), "-c", "import vllm.a; print(vllm.a.V, vllm.__version__)"],
                             capture_output=True, text=True, check=True).stdout.split()
        assert out in (["A", A_VERSION], ["B", B_VERSION]) and (out[0] == "B") == (tree == new_tree), at
        install(wheels[1], env, with_deps=False)
        assert snapshot(env) == snapshot(pip_b), at


def test_a_kill_while_pip_stages_leaves_the_old_install(env_with_a: Path, tmp_path: Path) -> None:
    env = _copy_env(env_with_a, tmp_path / "env")
    (tmp_path / "c").mkdir()
    wheel = make_wheel(tmp_path / "c", B_FILES, B_VERSION, requires=("numpy", "six"))  # the pip path
    proc = subprocess.Popen([sys.executable, "-c", KILLER, "0", str(wheel), str(env)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stage = _site(env) / ".overlay-install"
    deadline = time.monotonic() + 30
    while not (stage / "root").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    assert _tree(_site(env)) == _tree(_site(env_with_a))
    assert install(wheel, env, with_deps=False).how == "pip"
    _record_true(env)
    assert not stage.exists()


@pytest.mark.slow
def test_real_wheel_one_patch_edit_installs_incrementally(base_wheel: Path, tmp_path: Path) -> None:
    """The real base: an environment holding the installed patched vLLM (hard-linked from ``.venv``), one
    patch line edited, rebuilt and installed: only the changed files are written and RECORD stays true."""
    from overlay.bench.build import _edit
    from overlay.build.pipeline import build

    live = Path(sysconfig.get_path("platlib"))
    infos = list(live.glob("vllm-*.dist-info"))
    if len(infos) != 1 or not (infos[0] / "RECORD").is_file():
        pytest.skip(f"no whole vllm install in {live} (run make build)")
    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env)
    site = _site(env)
    for name in ("vllm", infos[0].name):
        subprocess.run(["cp", "-al", str(live / name), str(site / name)], check=True)
    (env / "bin" / "vllm").write_bytes((Path(sys.prefix) / "bin" / "vllm").read_bytes())
    patches = tmp_path / "patches"
    default = default_version(REPO / "patches")  # the release installed in .venv, as base_wheel is
    shutil.copytree(REPO / "patches" / default, patches / default)
    _edit(patches, default, 7)
    wheel = build(patches, default, tmp_path / "dist", base_wheel=base_wheel).wheel
    done = install(wheel, env, with_deps=False)
    assert done.how == "incremental" and done.written < 40
    _record_true(env)
    with zipfile.ZipFile(wheel) as zf:
        version = zf.read("vllm/_version.py")
    assert (site / "vllm" / "_version.py").read_bytes() == version
    assert [p.name for p in site.glob("vllm-*.dist-info")] == [wheel.name.split("-cp38")[0] + ".dist-info"]
