"""Whether a carried patch is on the path GLM-5 runs on the target, said positively: its GLM-5 path
harness tests (``tests/patches/test_<patch>__glm5_path.py``) all pass with it on the target and some fail
by behaviour without it. ``make rebase`` records that as ``on_model_path`` in ``rebase.json`` (which
``make status`` reads), with the counts; the negative verdict is the ``off-model-path`` outcome.
"""

from __future__ import annotations

import ast
from pathlib import Path

from overlay.maintain.rebase.testrun import TestRun, test_file

SUFFIX = "__glm5_path"


def path_tests(tests_dir: Path, patch_name: str) -> tuple[Path, frozenset[str]]:
    """The patch's GLM-5 path test file and the names of the test functions it defines (none when the
    file is missing or does not parse: the patch has no path tests to judge by)."""
    main = test_file(tests_dir, patch_name)
    path = main.with_name(f"{main.stem}{SUFFIX}.py")
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return path, frozenset()
    return path, frozenset(n.name for n in tree.body
                           if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test_"))


def _ours(names: frozenset[str], tests: tuple[str, ...]) -> list[str]:
    return [t for t in tests if t.split("[", 1)[0] in names]


def on_path(tests_dir: Path, patch_name: str, release: str, with_it: TestRun, without: TestRun | None) -> str:
    """The evidence that GLM-5 runs the patch on ``release``, or "" when its path tests do not show it (none,
    one failing with it, none failing by behaviour without it, or no run without it)."""
    path, names = path_tests(tests_dir, patch_name)
    if not names or without is None:
        return ""
    passed, failed = _ours(names, with_it.passed), _ours(names, with_it.failed)
    failed_without = _ours(names, without.behaviour_failed)
    if not passed or failed or not failed_without:
        return ""
    return (f"{path.name} on the {release} tree: {len(passed)} passed with it, {len(failed_without)} failed by "
            "behaviour without it")
