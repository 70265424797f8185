"""``make upstream-tests`` on fakes: a tiny sdist, fake vllm modules and upstream tests, no network."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from overlay.build.pins import carried_releases
from overlay.build.sdist import extract_subtree
from overlay.errors import FetchError
from overlay.maintain.upstream_tests import (
    Expectations,
    ExpectedFailure,
    Outcome,
    UpstreamTestsError,
    imported_modules,
    judge,
    module_name,
    run_pytest,
    select_tests,
)
from overlay.maintain.upstream_tests import (
    tests_tree as make_tests_tree,
)


def _sdist(tmp_path: Path, files: dict[str, str]) -> Path:
    path = tmp_path / "vllm-9.9.9.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-9.9.9/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


FAKE_TESTS = {
    "vllm/ops/dcp.py": "X = 1\n",
    "tests/__init__.py": "",
    "tests/ops/test_dcp.py": (
        "from vllm.ops import dcp\n\n"
        "def test_ok():\n    assert dcp.X == 1\n\n"
        "def test_contract():\n    assert dcp.X == 2, 'contract changed'\n\n"
        "def test_skipped():\n    import pytest\n    pytest.skip('needs CUDA')\n"
    ),
    "tests/ops/test_other.py": "import vllm.other\n\ndef test_unrelated():\n    assert False\n",
    "tests/ops/helper.py": "import vllm.ops.dcp\n",
}


def test_extract_subtree_takes_only_tests(tmp_path: Path) -> None:
    sdist = _sdist(tmp_path, FAKE_TESTS)
    n = extract_subtree(sdist, "tests/", tmp_path / "out" / "tests")
    assert n == 4
    assert sorted(p.name for p in (tmp_path / "out" / "tests" / "ops").iterdir()) == [
        "helper.py", "test_dcp.py", "test_other.py"]
    assert not (tmp_path / "out" / "vllm").exists()
    with pytest.raises(FetchError, match="exists; the tests/ tree goes into a fresh folder"):
        extract_subtree(sdist, "tests/", tmp_path / "out" / "tests")


@pytest.mark.parametrize(("path", "mod"), [
    pytest.param("vllm/v1/attention/ops/dcp_utils.py", "vllm.v1.attention.ops.dcp_utils", id="module"),
    pytest.param("vllm/ops/__init__.py", "vllm.ops", id="package"),
    pytest.param("csrc/x.cu", None, id="kernel"),
])
def test_module_name(path: str, mod: str | None) -> None:
    assert module_name(path) == mod


def test_imported_modules_sees_every_form() -> None:
    src = ("import vllm.a.b\nfrom vllm.c import d\n"
           "def f():\n    from vllm.e.f import g as h\n    import vllm.x as y\n")
    got = imported_modules(src)
    assert {"vllm.a.b", "vllm.c", "vllm.c.d", "vllm.e.f", "vllm.e.f.g", "vllm.x"} <= got


def test_selection_rule(tmp_path: Path) -> None:
    root = tmp_path / "r"
    extract_subtree(_sdist(tmp_path, FAKE_TESTS), "tests/", root / "tests")
    assert select_tests(root / "tests", {"vllm.ops.dcp"}) == {"tests/ops/test_dcp.py": ("vllm.ops.dcp",)}
    assert select_tests(root / "tests", {"vllm.ops.dcp", "vllm.other"}, ()) == {
        "tests/ops/test_dcp.py": ("vllm.ops.dcp",), "tests/ops/test_other.py": ("vllm.other",)}
    from overlay.maintain.upstream_tests import Excluded

    excl = (Excluded("tests/ops/test_other.py", "unrelated"),)
    assert list(select_tests(root / "tests", {"vllm.other"}, excl)) == []


def test_expectations_validation() -> None:
    data = {"expected_failure": [{"test": "tests/a.py::t", "patch": "nope.patch", "reason": ""},
                                 {"test": "a.py", "patch": "p.patch", "reason": "r"}],
            "bogus": 1}
    with pytest.raises(UpstreamTestsError) as exc:
        Expectations.from_dict(data, "x.toml", {"p.patch"})
    assert str(exc.value) == (
        "x.toml: unknown key(s) 'bogus'; expected_failure[0]: missing or empty 'reason'; "
        "expected_failure[1]: test 'a.py' is not a node id (tests/...py::name)")


@pytest.mark.parametrize("release", carried_releases(Path(__file__).resolve().parent.parent / "patches"))
def test_every_carried_release_has_its_expectations(release: str) -> None:
    """Each release keeps its own reviewed expectations in its folder, naming only its own patches."""
    from overlay.build.series import Series
    from overlay.maintain.upstream_tests import EXPECTED_NAME

    patches = Path(__file__).resolve().parent.parent / "patches"
    names = {p.name for p in Series.load(patches / release).patches}
    exp = Expectations.load(patches / release / EXPECTED_NAME, names)
    assert all(e.reason for e in exp.expected) and all(e.reason for e in exp.exclude_modules)


def test_relative_results_and_tree_paths_work_from_the_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``make upstream-tests`` passes ``--out upstream-tests`` (relative); pytest runs in the cache."""
    sdist = _sdist(tmp_path, FAKE_TESTS)
    root = make_tests_tree(sdist, "cd" * 32, "9.9.9", tmp_path / "cache")
    (tmp_path / "site" / "vllm" / "ops").mkdir(parents=True)
    for rel, text in (("__init__.py", ""), ("ops/__init__.py", ""), ("ops/dcp.py", "X = 1\n")):
        (tmp_path / "site" / "vllm" / rel).write_text(text)
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    got = run_pytest(root, ["tests/ops/test_dcp.py"], timeout=60, extra_path=[Path("site")],
                     results=Path("out") / "r.jsonl")
    assert got["tests/ops/test_dcp.py::test_ok"].outcome == "passed"


def test_run_and_judge_fresh_and_stale(tmp_path: Path) -> None:
    """The fake upstream tests really run under pytest with the plugin: a fresh expected failure is
    fine, a stale one (passes) and an unlisted failure are reported, a base failure is set apart."""
    cache = tmp_path / "cache"
    sdist = _sdist(tmp_path, FAKE_TESTS)
    root = make_tests_tree(sdist, "ab" * 32, "9.9.9", cache)
    fake_vllm = tmp_path / "site"
    (fake_vllm / "vllm" / "ops").mkdir(parents=True)
    (fake_vllm / "vllm" / "__init__.py").write_text("")
    (fake_vllm / "vllm" / "ops" / "__init__.py").write_text("")
    (fake_vllm / "vllm" / "ops" / "dcp.py").write_text("X = 1\n")
    (fake_vllm / "vllm" / "other.py").write_text("")
    got = run_pytest(root, ["tests/ops/test_dcp.py", "tests/ops/test_other.py"], timeout=60,
                     extra_path=[fake_vllm], results=tmp_path / "r.jsonl")
    assert {n: o.outcome for n, o in got.items()} == {
        "tests/ops/test_dcp.py::test_ok": "passed",
        "tests/ops/test_dcp.py::test_contract": "failed",
        "tests/ops/test_dcp.py::test_skipped": "skipped",
        "tests/ops/test_other.py::test_unrelated": "failed",
    }
    assert got["tests/ops/test_dcp.py::test_contract"].message.startswith("AssertionError: contract changed")
    assert got["tests/ops/test_dcp.py::test_skipped"].message == "needs CUDA"

    fresh = (ExpectedFailure("tests/ops/test_dcp.py::test_contract", "p.patch", "deliberate"),)
    exp_failing, stale, on_base, regressions, unjudged = judge(got, {}, fresh)
    assert [r["test"] for r in exp_failing] == ["tests/ops/test_dcp.py::test_contract"]
    assert not stale and not unjudged and not on_base
    assert regressions == [{"test": "tests/ops/test_other.py::test_unrelated",
                            "message": "assert False"}]

    base = {"tests/ops/test_other.py::test_unrelated": Outcome("failed", "assert False")}
    stale_list = (ExpectedFailure("tests/ops/test_dcp.py::test_ok", "p.patch", "old"),
                  ExpectedFailure("tests/ops/test_dcp.py::test_gone", "p.patch", "old"),
                  ExpectedFailure("tests/ops/test_dcp.py::test_skipped", "p.patch", "old"))
    exp_failing, stale, on_base, regressions, unjudged = judge(got, base, stale_list)
    assert [(r["test"].split("::")[1], r["why"]) for r in stale] == [
        ("test_ok", "passes now: drop the entry"),
        ("test_gone", "not collected (renamed or removed upstream?)")]
    assert [r["test"] for r in unjudged] == ["tests/ops/test_dcp.py::test_skipped"]
    assert [r["test"] for r in on_base] == ["tests/ops/test_other.py::test_unrelated"]
    # test_contract is not listed in this second list: a failure of the patched tree alone
    assert [r["test"] for r in regressions] == ["tests/ops/test_dcp.py::test_contract"]


def test_run_pytest_harness_error(tmp_path: Path) -> None:
    root = make_tests_tree(_sdist(tmp_path, FAKE_TESTS), "cd" * 32, "9.9.9", tmp_path / "cache")
    with pytest.raises(UpstreamTestsError, match="exited 4 without a test verdict"):
        run_pytest(root, ["tests/ops/missing.py"], timeout=60, extra_path=[], results=tmp_path / "r.jsonl")


def test_report_json_roundtrip(tmp_path: Path) -> None:
    from overlay.maintain.upstream_tests import Report, format_markdown

    r = Report("9.9.9", {"vllm.ops.dcp": ("p.patch",)}, {"tests/ops/test_dcp.py": ("vllm.ops.dcp",)}, [],
               {"passed": 1, "failed": 1, "skipped": 0, "total": 2}, 1.0,
               stale=[{"test": "tests/a.py::t", "patch": "p.patch", "reason": "r", "why": "passes now"}])
    assert r.verdict == "fail"
    assert json.loads(json.dumps(r.to_dict()))["verdict"] == "fail"
    assert "## Stale expected failures (fail the gate)" in format_markdown(r)


def test_the_tests_run_without_the_model_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that would download a hub model fails at once (HF_HUB_OFFLINE) instead of retrying the
    network for a minute; a value the user set is kept."""
    files = {**FAKE_TESTS, "tests/ops/test_hub.py": (
        "import os\nfrom vllm.ops import dcp\n\n"
        "def test_offline():\n    assert os.environ.get('HF_HUB_OFFLINE') == '1'\n")}
    root = make_tests_tree(_sdist(tmp_path, files), "ef" * 32, "9.9.9", tmp_path / "cache")
    (tmp_path / "site" / "vllm" / "ops").mkdir(parents=True)
    for rel, text in (("__init__.py", ""), ("ops/__init__.py", ""), ("ops/dcp.py", "X = 1\n")):
        (tmp_path / "site" / "vllm" / rel).write_text(text)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    got = run_pytest(root, ["tests/ops/test_hub.py"], timeout=60, extra_path=[tmp_path / "site"],
                     results=tmp_path / "r.jsonl")
    assert got["tests/ops/test_hub.py::test_offline"].outcome == "passed"


def _release(tmp_path: Path, sdist: Path) -> Path:
    """``patches/9.9.9/`` with an sdist pin and an empty series."""
    d = tmp_path / "patches" / "9.9.9"
    d.mkdir(parents=True)
    (d / "pin.toml").write_text(f'version = "9.9.9"\nwheel = "vllm-9.9.9-py3-none-any.whl"\nsha256 = "{"0" * 64}"\n'
                                f'sdist = "{sdist.name}"\nsdist_sha256 = "{"ab" * 32}"\n')
    (d / "series").write_text("# empty\n")
    return tmp_path / "patches"


def test_a_cut_short_sdist_is_a_harness_failure(tmp_path: Path) -> None:
    """Issue 25 item 10: a cut-short cached sdist gave a clear message but exit 1 (fail); it is exit 2."""
    from overlay.maintain.upstream_tests import run

    sdist = _sdist(tmp_path, FAKE_TESTS)
    sdist.write_bytes(sdist.read_bytes()[:200])
    expected = tmp_path / "9.9.9.toml"
    expected.write_text("")
    with pytest.raises(UpstreamTestsError) as exc:
        run(_release(tmp_path, sdist), "9.9.9", tmp_path / "out", cache=tmp_path / "cache", sdist=sdist,
            expected_file=expected)
    assert exc.value.exit_code == 2 and str(exc.value).startswith(f"{sdist}: not a readable source archive")
    assert not (tmp_path / "out").exists()


def test_a_missing_expectations_file_is_named_and_stops_the_gate(tmp_path: Path) -> None:
    """Issue 25 item 11: ``upstream_expected/<version>.toml`` missing selected vLLM's whole suite (65 files
    instead of 13) and ended in pytest exit 4; now the missing file is named and nothing runs."""
    from overlay.maintain.upstream_tests import run

    sdist = _sdist(tmp_path, FAKE_TESTS)
    missing = tmp_path / "upstream_expected" / "9.9.9.toml"
    with pytest.raises(UpstreamTestsError) as exc:
        run(_release(tmp_path, sdist), "9.9.9", tmp_path / "out", cache=tmp_path / "cache", sdist=sdist,
            expected_file=missing)
    assert exc.value.exit_code == 2
    assert str(exc.value).startswith(f"{missing}: missing: the release's expectations")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


def test_upstream_tests_refuse_another_releases_build(tmp_path: Path, capsys) -> None:
    """`make upstream-tests VLLM=<a release not installed here>` ran that release's tests against the installed
    build (another release's) and judged it; now it stops in one line, exit 2, before any sdist is read."""
    from importlib.metadata import version

    from overlay.cli import main

    repo = Path(__file__).resolve().parent.parent
    other = next(r for r in carried_releases(repo / "patches") if r != version("vllm").split("+", 1)[0])
    assert main(["upstream-tests", "--vllm", other, "--out", str(tmp_path / "u")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: upstream-tests --vllm {other}: the installed vLLM is ")
    assert len(err.splitlines()) == 1
    assert err.endswith("vLLM's own tests judge the build this environment imports")
    assert not (tmp_path / "u").exists()
