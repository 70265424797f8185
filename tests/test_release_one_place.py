"""A release lives in one place: ``patches/<release>/`` (and what its own tree says, ``overlay/releases/``).

Every carried release is accepted by every tool that keys anything by release, and so is a release added
by copying a carried one's folder to a new name with its own ``pin.toml``: no code names a release by
value (:func:`test_no_release_is_keyed_by_value_in_code`). What a person decides when carrying a release,
and what the tools derive: ``docs/rebase/README.md``, "Carrying a release".
"""

from __future__ import annotations

import ast
import dataclasses
import re
import shutil
from pathlib import Path

import pytest

from overlay.build.pins import Pin, carried_releases, default_version, load_pin
from overlay.build.series import Series
from overlay.engine.variants import expectations
from overlay.image.plan import plan_image
from overlay.maintain import upstream_reports
from overlay.maintain.rebase.matrix import newer_pinned
from overlay.maintain.upstream_tests import EXPECTED_NAME, Expectations
from overlay.releases import engine_cases

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"
RELEASES = carried_releases(PATCHES)
VLLM_RELEASE = re.compile(r"^0\.[1-9]\d\.\d+(?:\.post\d+|rc\d+)?$")  # vLLM's own releases (not torch's, nor others')
NEW = "0.32.0"  # the copied release's name: a vLLM release no code knows


def _accepted(root: Path, release: str) -> None:
    """What each tool reads of a release, read as that tool reads it."""
    pin = load_pin(root, release)
    series = Series.load(root / release).require_patches("a carried release")
    names = {p.name for p in series.patches}
    Expectations.load(root / release / EXPECTED_NAME, names)  # upstream-tests' gate
    table = engine_cases.load(release, root)  # the engine check's acts and variant expectations
    upstream_reports.load(root, release)  # `make status`'s judged upstream reports
    assert set(table.acts) <= names and set(table.expect) <= {"stock", *names}
    assert expectations(release, "stock")  # engine-variants: its own or the default's
    plan = plan_image(root, release)  # the image over the release's own base image
    assert plan.version == pin.version and plan.patches == tuple(p.name for p in series.patches)
    assert pin.torch, f"patches/{release}/pin.toml: no torch (the Makefile makes the release's environment on it)"


@pytest.mark.parametrize("release", RELEASES)
def test_every_carried_release_is_accepted_by_every_tool(release: str) -> None:
    _accepted(PATCHES, release)


def test_the_carried_releases_are_productions_and_the_newest() -> None:
    """Carried: production's release and the newest; the default (``patches/DEFAULT``) is one of them."""
    assert len(RELEASES) >= 1 and default_version(PATCHES) in RELEASES


def test_a_copied_release_is_accepted_with_no_code_change(tmp_path: Path) -> None:
    """``patches/<default>/`` copied to a new name with its own pin: every tool takes it; flipping DEFAULT to it
    is a one-line change that the tools follow."""
    root = tmp_path / "patches"
    shutil.copytree(PATCHES, root, ignore=shutil.ignore_patterns("REBASE.md", "rebase.json"))
    default = default_version(PATCHES)
    shutil.copytree(PATCHES / default, root / NEW, ignore=shutil.ignore_patterns("REBASE.md", "rebase.json"))
    pin = load_pin(PATCHES, default)
    wheel = pin.wheel.replace(f"vllm-{default}-", f"vllm-{NEW}-")
    (root / NEW / "pin.toml").write_text(dataclasses.replace(pin, version=NEW, wheel=wheel, sdist=None,
                                                             sdist_sha256=None).to_toml())
    assert NEW in carried_releases(root)
    _accepted(root, NEW)
    (root / "DEFAULT").write_text(f"{NEW}\n")
    assert default_version(root) == NEW
    assert NEW in newer_pinned(RELEASES[0], [root])


def _literals(path: Path) -> list[tuple[int, str]]:
    """(line, value) of every string constant in ``path`` that is a vLLM release, docstrings left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs and VLLM_RELEASE.match(n.value)]


def test_no_release_is_keyed_by_value_in_code() -> None:
    """No module of the tool, and neither the Makefile nor the scripts, names a vLLM release as a value: what
    the tools key by release is in the release's folder or read from its tree."""
    found = [f"{p.relative_to(REPO)}:{line}: {value!r}" for p in sorted((REPO / "overlay").rglob("*.py"))
             for line, value in _literals(p)]
    assert not found, "a release named in code: " + "; ".join(found)
    for path in [REPO / "Makefile", *sorted((REPO / "scripts").glob("*.sh"))]:
        code = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
        # an error message's example of the form ("a release like 0.30.0") names no release the tools key by
        named = [ln for ln in code
                 if re.search(r"(?<![\d.])0\.[1-9]\d\.\d+(?![\d.])", re.sub(r"like 0\.\d+\.\d+", "", ln))]
        assert not named, f"{path.relative_to(REPO)} names a release: {named[:2]}"


def test_the_check_finds_a_release_named_in_code(tmp_path: Path) -> None:
    """The guard itself: a dict keyed by a release is found, a docstring's example is not."""
    mod = tmp_path / "m.py"
    mod.write_text('"""Read in 0.28.0."""\nTABLE = {"0.28.0": 1}\nTORCH = "2.14.0"\n')
    assert _literals(mod) == [(2, "0.28.0")]


def test_the_pin_keeps_the_torch_pin(tmp_path: Path) -> None:
    pin = Pin("9.9.9", "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl", "0" * 64, torch="2.14.0")
    (tmp_path / "pin.toml").write_text(pin.to_toml())
    assert Pin.load(tmp_path / "pin.toml", tmp_path.parent).torch == "2.14.0"
    from overlay.errors import PinError

    with pytest.raises(PinError, match=r"field 'torch' is not a torch release like 2\.14\.0: 'latest'"):
        Pin.from_dict({**dataclasses.asdict(pin), "torch": "latest"}, "pin.toml")
