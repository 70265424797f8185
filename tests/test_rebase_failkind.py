"""A patch's test run tells a harness error from a behaviour failure (``overlay/maintain/rebase/failkind.py``,
read by ``overlay/maintain/rebase/testrun.py``): real pytest runs of small test files against a tiny tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from overlay.maintain.rebase.testrun import TestRun, run_files

TESTS = Path(__file__).resolve().parent

CODE = '''
def guard(meta):
    return meta["decode"]


def build(table):
    return table[0]
'''

HELPER = '''
import vllm.fix


def make():
    return vllm.fix.build(len)  # raises inside the code under test, called by the harness
'''

TEST = f'''
import sys

sys.path.insert(0, {str(TESTS)!r})  # tests/compat.py
import compat
import helper
import pytest
import vllm.fix


class Meta:
    decode = "d"


@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")


def test_code_raises():
    assert vllm.fix.guard(Meta()) == "d"


def test_assertion():
    assert 1 == 2


def test_own_error():
    {{}}["missing"]


def test_fixture(broken):
    pass


def test_setup_region():
    with compat.setup("building the batch"):
        helper.make()


def test_exercising_region():
    with compat.exercising("the guard"):
        raise KeyError("decode")


def test_added_name_missing():
    compat.added("cp_utils", "not_there")


def test_off_the_models_path():
    raise compat.OffModelPath("the projection is in the tree but not on the path GLM-5 runs")


def test_passes():
    pass


@pytest.mark.skip(reason="not on this release")
def test_skipped():
    pass
'''


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A tiny ``vllm`` the tests import (``compat.added`` looks in its ``v1/worker/cp_utils.py``)."""
    root = tmp_path / "tree"
    (root / "vllm" / "v1" / "worker").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text('__version__ = "0.28.0"\n')
    (root / "vllm" / "v1" / "__init__.py").write_text("")
    (root / "vllm" / "v1" / "worker" / "__init__.py").write_text("")
    (root / "vllm" / "v1" / "worker" / "cp_utils.py").write_text("")
    (root / "vllm" / "fix.py").write_text(CODE)
    return root


def _write(tmp_path: Path, files: dict[str, str]) -> Path:
    tests = tmp_path / "tests"
    tests.mkdir()
    for name, text in files.items():
        (tests / name).write_text(text)
    return tests


def test_each_failure_is_told_harness_or_behaviour(tmp_path: Path, tree: Path) -> None:
    tests = _write(tmp_path, {"helper.py": HELPER, "test_x.py": TEST})
    run = run_files([tests / "test_x.py"], tree, cwd=tests)
    kinds = dict(zip(run.failed, run.kinds, strict=True))
    assert kinds == {
        "test_code_raises": "behaviour",  # raised inside the code under test
        "test_assertion": "behaviour",
        "test_own_error": "harness",  # raised by the test itself
        "test_fixture": "harness",
        "test_setup_region": "harness",  # raised in vLLM, but inside compat.setup(...)
        "test_exercising_region": "behaviour",
        "test_added_name_missing": "behaviour",  # a name the patch adds is missing: the bug itself
        "test_off_the_models_path": "off-path",  # in the tree, but the model's path does not take it
    }
    assert run.status == "failed" and run.passed == ("test_passes",)
    assert run.skipped == ("test_skipped",) and run.skip_reason == "not on this release"
    reasons = dict(zip(run.failed, run.reasons, strict=True))
    assert reasons["test_setup_region"].startswith("compat.HarnessError: building the batch: TypeError: "
                                                   "'builtin_function_or_method' object is not subscriptable")
    where = dict(zip(run.failed, run.where, strict=True))
    assert where["test_setup_region"] == "helper.py:6"  # the harness line, not the region's re-raise
    assert where["test_own_error"].startswith("test_x.py:")
    assert run.behaviour_failed == ("test_code_raises", "test_assertion", "test_exercising_region",
                                    "test_added_name_missing", "test_off_the_models_path")
    assert run.off_path_failed == ("test_off_the_models_path",)
    assert not run.cannot_run
    assert run.first_error() == f"KeyError: 'missing' (test_own_error, at {where['test_own_error']})"


def test_only_harness_errors_mean_the_tests_cannot_run(tmp_path: Path, tree: Path) -> None:
    tests = _write(tmp_path, {"test_y.py": "import vllm.fix\n\n\ndef test_a():\n    vllm.fix.gone()\n\n\n"
                                           "def test_b():\n    pass\n"})
    run = run_files([tests / "test_y.py"], tree, cwd=tests)
    assert (run.status, run.failed, run.kinds, run.passed) == ("harness", ("test_a",), ("harness",), ("test_b",))
    assert run.cannot_run
    assert run.first_error().startswith("AttributeError: module 'vllm.fix' has no attribute 'gone' (test_a, at ")


def test_a_run_takes_the_marker_expression_it_is_given(tmp_path: Path, tree: Path) -> None:
    """``marks`` selects the run's tests (``-m``): by default every test but the GPU ones."""
    tests = _write(tmp_path, {"conftest.py": "def pytest_configure(config):\n    for m in ('long', 'gpu'):\n"
                                             "        config.addinivalue_line('markers', m)\n",
                              "test_m.py": "import pytest\n\n\ndef test_short():\n    pass\n\n\n"
                                           "@pytest.mark.long\ndef test_long():\n    pass\n\n\n"
                                           "@pytest.mark.gpu\ndef test_gpu():\n    pass\n"})
    everything = run_files([tests / "test_m.py"], tree, cwd=tests)
    short = run_files([tests / "test_m.py"], tree, cwd=tests, marks="not gpu and not long")
    long = run_files([tests / "test_m.py"], tree, cwd=tests, marks="long and not gpu")
    assert (everything.passed, short.passed, long.passed) == (("test_short", "test_long"), ("test_short",),
                                                              ("test_long",))


def test_an_import_error_of_a_test_only_name_is_a_harness_error(tmp_path: Path, tree: Path) -> None:
    tests = _write(tmp_path, {"test_z.py": "from helper_gone import thing\n\n\ndef test_a():\n    pass\n"})
    run = run_files([tests / "test_z.py"], tree, cwd=tests)
    assert run.status == "harness" and run.kinds == ("harness",)
    assert "No module named 'helper_gone'" in run.first_error()


def test_a_run_that_skips_everything_passes_nothing(tmp_path: Path, tree: Path) -> None:
    tests = _write(tmp_path, {"test_s.py": "import pytest\n\n\ndef test_a():\n    pytest.skip('Triton only')\n"})
    run = run_files([tests / "test_s.py"], tree, cwd=tests)
    assert run.status == "skipped" and run.cannot_run
    assert run.first_error() == "every test skipped: Triton only"


def test_a_gpu_only_error_raised_in_the_code_is_the_harness_s(tmp_path: Path, tree: Path) -> None:
    (tree / "vllm" / "fix.py").write_text(CODE + "\n\ndef pinned():\n    raise RuntimeError('pin_memory=True "
                                          "requires a CUDA or other accelerator backend')\n")
    tests = _write(tmp_path, {"test_g.py": "import vllm.fix\n\n\ndef test_a():\n    vllm.fix.pinned()\n"})
    run = run_files([tests / "test_g.py"], tree, cwd=tests)
    assert run.status == "harness"


def test_an_accelerator_error_is_the_harness_s_wherever_it_surfaced(tmp_path: Path, tree: Path) -> None:
    """0.34.0's FlashMLA-sparse ``__init__`` reads ``torch.accelerator.current_device_index()``: on CPU that
    raises inside the harness's ``compat.exercising`` region (and in a rank, whose report the test re-raises
    as a behaviour failure); the harness did not stand in for the GPU there, the patch did nothing wrong."""
    (tree / "vllm" / "fix.py").write_text(CODE + "\n\ndef index():\n    raise RuntimeError('Cannot access "
                                          "accelerator device when none is available.')\n")
    tests = _write(tmp_path, {"test_acc.py": f"import sys\n\nsys.path.insert(0, {str(TESTS)!r})\nimport compat\n"
                              "import vllm.fix\n\n\ndef test_in_region():\n    with compat.exercising('the layer'):\n"
                              "        vllm.fix.index()\n\n\ndef test_rank_report():\n"
                              "    raise compat.BehaviourFailure('rank 0: BehaviourFailure: the layer: RuntimeError: "
                              "Cannot access accelerator device when none is available.')\n\n\n"
                              "def test_still_behaviour():\n    with compat.exercising('the guard'):\n"
                              "        vllm.fix.guard({})\n"})
    run = run_files([tests / "test_acc.py"], tree, cwd=tests)
    assert dict(zip(run.failed, run.kinds, strict=True)) == {
        "test_in_region": "harness", "test_rank_report": "harness", "test_still_behaviour": "behaviour"}


def test_reports_written_before_the_kinds_read_as_behaviour() -> None:
    old = {"status": "failed", "passed": ["a"], "failed": ["b"], "summary": "1 failed, 1 passed",
           "reasons": ["assert 1 == 2"]}
    run = TestRun.from_dict(old)
    assert run.behaviour_failed == ("b",) and not run.cannot_run
    assert TestRun.from_dict(run.to_dict()) == run


def test_code_under_test_that_does_not_compile_is_the_behaviour_s(tmp_path: Path, tree: Path) -> None:
    """A conflict candidate whose merge left broken lines: the tests stop where vLLM is imported
    (collection, a fixture, a ``compat.setup`` region), and that is the code's failure, not the
    harness's; a test helper that does not compile stays the harness's."""
    (tree / "vllm" / "merged.py").write_text("def f(:\n    pass\n")
    tests = _write(tmp_path, {
        "test_collect.py": "import vllm.merged\n\n\ndef test_a():\n    pass\n",
        "test_fixture.py": f"import sys\n\nsys.path.insert(0, {str(TESTS)!r})\nimport compat\nimport pytest\n\n\n"
                           "@pytest.fixture\ndef merged():\n    import vllm.merged\n\n\n"
                           "def test_f(merged):\n    pass\n\n\n"
                           "def test_setup():\n    with compat.setup('the layer'):\n"
                           "        import vllm.merged  # noqa\n",
        "helper_broken.py": "def g(:\n    pass\n",
        "test_helper.py": "import helper_broken\n\n\ndef test_h():\n    pass\n",
    })
    collect = run_files([tests / "test_collect.py"], tree, cwd=tests)
    assert (collect.status, collect.kinds) == ("failed", ("behaviour",))
    assert collect.reasons[0].startswith("SyntaxError")
    inner = run_files([tests / "test_fixture.py"], tree, cwd=tests)
    assert dict(zip(inner.failed, inner.kinds, strict=True)) == {"test_f": "behaviour", "test_setup": "behaviour"}
    helper = run_files([tests / "test_helper.py"], tree, cwd=tests)
    assert (helper.status, helper.kinds) == ("harness", ("harness",))
