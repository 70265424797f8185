"""A release's test runs get that release's whole resolved dependency set and this environment's CPU
torch, nothing else of this environment (``overlay/maintain/rebase/deps.py``), found by the release its
tree names (issue 35 item 1)."""

from __future__ import annotations

import tomllib
import zipfile
from importlib.metadata import distribution
from pathlib import Path
from types import SimpleNamespace

import pytest

from overlay.build.fetch import recorded_path
from overlay.maintain.rebase.deps import (
    DONE,
    RUNNER,
    Torch,
    deps_for,
    env_torch,
    key_of,
    own_torch,
    release_deps,
    roots,
    stub_wheel,
    tree_version,
)
from overlay.maintain.rebase.testrun import pytest_runner, run_files
from tests.wheelkit import make_wheel

REPO = Path(__file__).resolve().parent.parent
VERSION_PY = "__version__ = version = '9.9.0'\n__version_tuple__ = version_tuple = (9, 9, 0)\n"
TORCH = Torch("2.13.0+cpu", ("filelock", "sympy>=1.13.3", 'pyyaml; extra == "pyyaml"'), ())


def _wheel(tmp_path: Path, *requires: str) -> Path:
    (tmp_path / "w").mkdir(parents=True, exist_ok=True)
    return make_wheel(tmp_path / "w", {"vllm/__init__.py": b""}, "9.9.0", requires=requires)


def test_the_tree_names_its_release(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    assert tree_version(tmp_path) is None
    (tmp_path / "vllm" / "_version.py").write_text("# generated\n" + VERSION_PY)
    assert tree_version(tmp_path) == "9.9.0"


def test_the_roots_keep_extras_and_leave_the_torch_family_to_stand_ins(tmp_path: Path) -> None:
    """0.28.0 requires fastapi[standard]: the closure that dropped the extra had fastapi and uvicorn
    but not uvloop, which vLLM imports (a fresh clone's old-base runs stopped there). A release pinning this
    environment's torch runs on it (a stand-in in the resolution); one pinning another torch gets its own."""
    wheel = _wheel(tmp_path, "fastapi[standard]<0.137.0,>=0.133.0", "packaging>=1", "torch==2.13.0",
                   "torchvision==0.28.0", "torchcodec>=0.14", "pywin32==1; sys_platform == 'win32'")
    reqs, stubs = roots(wheel, TORCH)
    assert reqs == ["fastapi[standard]<0.137.0,>=0.133.0", "packaging>=1", *RUNNER]
    assert stubs == {"torch": ("2.13.0", TORCH.requires), "torchvision": ("0.28.0", ())}
    assert own_torch(wheel, TORCH) is None
    _, unpinned = roots(_wheel(tmp_path / "u", "numpy"), TORCH)
    assert unpinned == {"torch": ("2.13.0", TORCH.requires)}  # this torch's version, its local label dropped
    other = _wheel(tmp_path / "o", "packaging>=1", "torch==2.14.0", "torchvision==0.29.0")
    reqs, stubs = roots(other, TORCH)
    assert own_torch(other, TORCH) == "2.14.0"
    assert reqs == ["packaging>=1", "torch==2.14.0", *RUNNER] and stubs == {"torchvision": ("0.29.0", ())}
    assert key_of(other, TORCH, reqs, stubs) == key_of(other, Torch("2.15.0", (), ()), reqs, stubs)  # not this one's


def test_a_pin_the_index_does_not_serve_resolves_at_its_stand_in(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """0.34.0 pins flashinfer-python==0.7.3, which PyPI never served: the resolution asks for the version
    ``VERSION_STAND_INS`` names (extras and markers kept, another pin of the same name untouched); an
    unserved pin the table does not name is one line naming the requirement and the table."""
    from overlay.build import stand_ins
    from overlay.maintain.rebase import deps

    wheel = _wheel(tmp_path, "flashinfer-python==0.7.3", "flashinfer-cubin==0.7.3",
                   'other[x]==1.0; python_version >= "3.8"', "numpy>=2")
    monkeypatch.setitem(stand_ins.VERSION_STAND_INS, ("other", "1.0"), stand_ins.VersionStandIn("1.1", "test"))
    reqs, _ = roots(wheel, TORCH)
    assert reqs == ["flashinfer-cubin==0.7.3", "flashinfer-python==0.7.4", "numpy>=2",
                    'other[x]==1.1; python_version >= "3.8"', *RUNNER]
    assert all(s.evidence.strip() for s in stand_ins.VERSION_STAND_INS.values())
    line = "ERROR: No matching distribution found for flashinfer-cubin==0.7.3"
    monkeypatch.setattr(deps.subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=1, stderr=line + "\n"))
    with pytest.raises(deps.DepsError, match=r"flashinfer-cubin==0\.7\.3 \(the release pins flashinfer-cubin==0\.7\.3, "
                                             r"which the index does not serve: .*stand_ins.py:VERSION_STAND_INS\)$"):
        deps.pip_resolve(["flashinfer-cubin==0.7.3"])


def test_the_stand_in_is_a_wheel_of_metadata_only(tmp_path: Path) -> None:
    path = stub_wheel(tmp_path, "torch", "2.14.0", TORCH.requires)
    assert path.name == "torch-2.14.0-py3-none-any.whl"
    with zipfile.ZipFile(path) as zf:
        assert sorted(zf.namelist()) == ["torch-2.14.0.dist-info/METADATA", "torch-2.14.0.dist-info/RECORD",
                                         "torch-2.14.0.dist-info/WHEEL"]
        meta = zf.read("torch-2.14.0.dist-info/METADATA").decode()
    assert "Requires-Dist: sympy>=1.13.3\n" in meta and "Version: 2.14.0\n" in meta


def test_the_runner_is_the_projects_own_test_pins() -> None:
    test = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert set(RUNNER) <= set(test)


def test_release_deps_resolves_and_installs_once_by_key(tmp_path: Path) -> None:
    asked: list[list[str]] = []
    installed: list[list[str]] = []

    def resolve(reqs: list[str]) -> list[str]:
        asked.append(reqs)
        return ["dep-only-here==2.0", "pytest==9.2.0"]

    def install(pins: list[str], dest: Path) -> None:
        installed.append(pins)
        (dest / "dep_only_here.py").write_text("VALUE = 7\n")

    wheel = _wheel(tmp_path, "dep-only-here[extra]==2.0", "torch==2.13.0")
    first = release_deps("9.9.0", wheel, cache=tmp_path / "cache", resolver=resolve, installer=install, torch=TORCH)
    again = release_deps("9.9.0", wheel, cache=tmp_path / "cache", resolver=resolve, installer=install, torch=TORCH)
    assert first == again and first.name.startswith("9.9.0-") and first.parent == tmp_path / "cache" / "deps"
    assert asked == [["dep-only-here[extra]==2.0", *RUNNER]] and installed == [["dep-only-here==2.0", "pytest==9.2.0"]]
    assert (first / DONE).read_text().split() == ["dep-only-here==2.0", "pytest==9.2.0"]
    other = Torch("2.14.0", TORCH.requires, ())  # another torch is another environment
    assert release_deps("9.9.0", wheel, cache=tmp_path / "cache", resolver=resolve, installer=install,
                        torch=other) != first


def test_a_failed_install_leaves_nothing_to_reuse(tmp_path: Path) -> None:
    def install(pins: list[str], dest: Path) -> None:
        (dest / "half.py").write_text("")
        raise OSError("disk full")

    with pytest.raises(OSError):
        release_deps("9.9.0", _wheel(tmp_path), cache=tmp_path / "cache", resolver=lambda r: ["x==1"],
                     installer=install, torch=TORCH)
    assert not [p for p in (tmp_path / "cache" / "deps").iterdir() if not p.name.startswith(".")]


def _link_dist(name: str, dest: Path) -> None:
    """This environment's distribution ``name`` linked into ``dest`` (a stand-in for pip --target)."""
    dist = distribution(name)
    base = Path(str(dist.locate_file("")))
    for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
        if (base / top).exists() and not (dest / top).exists():
            (dest / top).symlink_to(base / top)


def _runner_folder(dest: Path) -> Path:
    """A release's set as far as the runner and torch need it: pytest and what this torch requires."""
    dest.mkdir()
    for name in ("pytest", "pluggy", "iniconfig", "packaging", "pygments", "pytest-timeout", "filelock",
                 "typing-extensions", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec", "setuptools"):
        _link_dist(name, dest)
    return dest


def test_a_tree_runs_with_its_releases_set_and_nothing_else_of_this_environment(tmp_path: Path) -> None:
    """Whatever .venv holds: a module installed here (yaml) but not in the release's set does not
    import in the run; the release's own dependency does; torch is this environment's."""
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    (tree / "vllm" / "_version.py").write_text(VERSION_PY)
    (tree / "vllm" / "kernels.py").write_text("import dep_only_here\n\n\ndef value():\n"
                                              "    return dep_only_here.VALUE\n")
    deps = _runner_folder(tmp_path / "deps")
    (deps / "dep_only_here.py").write_text("VALUE = 7\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_p.py").write_text(
        "import importlib.util\n\nimport torch\n\nimport vllm.kernels\n\n\n"
        "def test_value():\n    assert vllm.kernels.value() == 7\n\n\n"
        "def test_nothing_else_of_the_environment():\n    assert importlib.util.find_spec('yaml') is None\n\n\n"
        "def test_torch_is_this_environments():\n"
        f"    assert torch.__version__.split('+')[0] == {env_torch().version.split('+')[0]!r}\n")
    without = run_files([tests / "test_p.py"], tree, cwd=tests)
    assert without.status == "harness"  # this environment lacks the release's dependency: not the behaviour
    assert "No module named 'dep_only_here'" in without.first_error()
    runner = pytest_runner(tests, deps=deps_for({"9.9.0": Path("unused.whl")}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("overlay.maintain.rebase.deps.release_deps", lambda release, wheel: deps)
        run = runner(SimpleNamespace(name="p.patch"), tree)
        assert runner.environment(tree) is not None  # its runs are kept by the release's set, not by .venv
    assert run is not None and run.status == "passed", run
    assert len(run.passed) == 3 and run.environment == recorded_path(deps)


def test_a_frame_in_the_releases_set_is_library_code(tmp_path: Path) -> None:
    """The set's folder has no site-packages in its path: an exception its packages raise from a call
    of the code under test is still the behaviour's, as it was with the packages in .venv."""
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    (tree / "vllm" / "_version.py").write_text(VERSION_PY)
    (tree / "vllm" / "config.py").write_text("import strict_lib\n\n\ndef make():\n    return strict_lib.check(-1)\n")
    deps = _runner_folder(tmp_path / "deps")
    (deps / "strict_lib.py").write_text("def check(v):\n    if v < 0:\n        raise ValueError('negative')\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_p.py").write_text("import vllm.config\n\n\ndef test_make():\n    vllm.config.make()\n")
    run = run_files([tests / "test_p.py"], tree, cwd=tests, deps=deps)
    assert (run.status, run.kinds) == ("failed", ("behaviour",)), run
