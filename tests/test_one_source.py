"""Every list the code owns has one source; each place that repeats it is held to it here.

A list kept by hand in two places drifts: a fix missing from the engine check's seed bugs silently
got no variant, the rebase's outcomes were listed four times with three different counts, the
harness/behaviour rules twice in different words. Where a place cannot be derived from the source
(a guide, the README), a test here fails the moment the two part. The regress checks are held in
``tests/regress/test_checks_registry.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from overlay.build.pins import carried_releases, default_version
from overlay.build.series import Series
from overlay.engine.variants import EXPECT, NO_VARIANT
from overlay.maintain.rebase import failkind
from overlay.maintain.rebase.state import OUTCOMES, UPSTREAM

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
ARCHITECTURE = (REPO / "docs" / "ARCHITECTURE.md").read_text()
REBASE_GUIDE = (REPO / "docs" / "rebase" / "README.md").read_text()


VERSION = default_version(REPO / "patches")
RELEASES = carried_releases(REPO / "patches")
SERIES_FILE = f"patches/{VERSION}/series"


def series_names(release: str = VERSION) -> list[str]:
    series = Series.load(REPO / "patches" / release)
    return [p.name.removesuffix(".patch") for p in series.patches]


def section(text: str, heading: str) -> str:
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


# -- the patches: patches/<default>/series ------------------------------------------------------
# Every place a patch must reach, derived from ``series``: a patch missing from one fails naming the
# place. Its own tests (``tests/patches/test_<patch>.py``) are held by tests/test_patches_against_base.py.

def readme_series_rows(release: str = VERSION) -> list[str]:
    """The rows of the README's series table of ``release`` (its ``### <release>`` under ``## The series``)."""
    part = section(README, "## The series").split(f"\n### {release} ", 1)
    rows = part[1].split("\n### ", 1)[0] if len(part) == 2 else ""
    return re.findall(r"(?m)^\| `([a-z0-9-]+)` \|", rows)


def problem_items() -> list[list[str]]:
    """The series patches each numbered item of ARCHITECTURE's problem list names."""
    problem = section(ARCHITECTURE, "## The problem")
    items = re.findall(r"(?ms)^\d+\. .*?(?=^\d+\. |^\s*$)", problem)
    names = {n for r in RELEASES for n in series_names(r)}
    return [[n for n in re.findall(r"`([a-z0-9-]+)`", item) if n in names] for item in items]


def problem_plus() -> str | None:
    """The patch the problem list adds after its items ("One patch per item ..., plus `<patch>`")."""
    plus = re.search(r"One patch per item[^\n]*\n?[^\n]*plus `([a-z0-9-]+)`", section(ARCHITECTURE, "## The problem"))
    return plus[1] if plus else None


def build_guide_counts() -> list[int]:
    """The patch counts of the build guide's example output (``(0.28.0+ovl..., 8 patch(es), 0.38 s)``)."""
    text = (REPO / "docs" / "build" / "README.md").read_text()
    return [int(n) for n in re.findall(r"\((?:[^,()]+), (\d+) patch\(es\)", text)]


PLACES = {
    "README.md's series table of its release (## The series, ### <release>)":
        lambda p, r: p in readme_series_rows(r),
    "docs/ARCHITECTURE.md's problem list (an item, or its 'plus' line)":
        lambda p, r: p == problem_plus() or any(p in item for item in problem_items()),
    "overlay/engine/variants.py's EXPECT (or NO_VARIANT, saying why)":
        lambda p, r: f"{p}.patch" in EXPECT or f"{p}.patch" in NO_VARIANT,
}


@pytest.mark.parametrize(("release", "patch"), [(r, p) for r in RELEASES for p in series_names(r)])
def test_every_patch_reaches_every_place(release: str, patch: str) -> None:
    """A fix missing from ``EXPECT`` got no seed-bug variant, and ``make engine-variants`` did not say so."""
    missing = [place for place, has in PLACES.items() if not has(patch, release)]
    assert not missing, f"patches/{release}/series: {patch} is missing from " + "; ".join(missing)


def test_the_build_guides_example_counts_the_series() -> None:
    counts, n = build_guide_counts(), len(series_names())
    assert counts, "docs/build/README.md: no example build line '(<version>, N patch(es), ...)' found"
    assert set(counts) == {n}, f"docs/build/README.md's example says {counts} patch(es); {SERIES_FILE} has {n}"


@pytest.mark.parametrize("release", RELEASES)
def test_the_readme_series_table_is_the_series_in_order(release: str) -> None:
    rows, names = readme_series_rows(release), series_names(release)
    stale = [r for r in rows if r not in names]
    assert not stale, f"README.md's series table of {release} names {stale}, not in patches/{release}/series"
    assert rows == [n for n in names if n in rows], f"README.md's series table of {release} is not in its order"


def test_the_architecture_problem_list_names_one_patch_per_item() -> None:
    items, plus = problem_items(), problem_plus()
    assert plus, "docs/ARCHITECTURE.md's problem list: no 'One patch per item ..., plus `<patch>`' line"
    not_one = [i for i, named in enumerate(items) if len(named) != 1]
    assert not not_one, f"docs/ARCHITECTURE.md's problem items {not_one} do not name exactly one patch of the series"
    named = [n for item in items for n in item] + [plus]
    assert len(named) == len(set(named)), f"docs/ARCHITECTURE.md's problem list names a patch twice: {named}"


def test_the_seed_bug_variants_name_only_patches_of_the_series() -> None:
    patches = {f"{n}.patch" for r in RELEASES for n in series_names(r)}
    fixes = set(EXPECT) - {"stock"}
    both = sorted(fixes & set(NO_VARIANT))
    assert not both, f"overlay/engine/variants.py: {both} both in EXPECT and in NO_VARIANT"
    stale = sorted((fixes | set(NO_VARIANT)) - patches)
    assert not stale, f"overlay/engine/variants.py's EXPECT / NO_VARIANT name {stale}, in no carried series"
    assert all(why.strip() for why in NO_VARIANT.values()), "variants.py: a NO_VARIANT entry without its why"


# -- the rebase outcomes: overlay.maintain.rebase.state.OUTCOMES --------------------------------

def classifier_outcomes() -> set[str]:
    """Every outcome ``classify.py`` gives: ``Result(name, "<outcome>", ...)`` and ``res.outcome = ...``."""
    tree = ast.parse((REPO / "overlay" / "maintain" / "rebase" / "classify.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Result"
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
            found.add(node.args[1].value)
        if isinstance(node, ast.Assign):
            for target in node.targets:
                both = isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                pairs = zip(target.elts, node.value.elts, strict=False) if both else [(target, node.value)]
                for t, v in pairs:
                    if isinstance(t, ast.Attribute) and t.attr == "outcome" and isinstance(v, ast.Constant):
                        found.add(v.value)
    return found


def test_the_classifier_gives_exactly_the_outcomes() -> None:
    assert classifier_outcomes() == set(OUTCOMES)
    assert set(UPSTREAM) <= set(OUTCOMES)


def test_the_rebase_guide_lists_the_outcomes_in_order() -> None:
    table = REBASE_GUIDE.split("| outcome | when |", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"(?m)^\| `([a-z-]+)` \|", table) == list(OUTCOMES)


def test_the_package_docstrings_point_to_the_one_list() -> None:
    from overlay.maintain import rebase
    from overlay.maintain.rebase import classify

    for doc in (rebase.__doc__, classify.__doc__):
        assert "OUTCOMES" in doc


def test_a_result_with_an_unknown_outcome_is_refused() -> None:
    from overlay.maintain.rebase.state import Result

    with pytest.raises(ValueError, match="not an outcome"):
        Result("p.patch", "absorbed", "")


# -- "upstream by behaviour": overlay.maintain.rebase.verdict.behaviour_verdict -----------------

RULE = re.compile(r"fails? on the old base and pass(es)? on the target", re.IGNORECASE)


def test_upstream_by_behaviour_is_decided_and_stated_in_one_place() -> None:
    """The rule was written in the guide (twice), the package docstring and verdict.py, in different
    words, and the guide never named the function that decides; it is stated in
    ``behaviour_verdict``'s docstring, and the others point there without restating it."""
    from overlay.maintain import rebase
    from overlay.maintain.rebase import verdict

    doc = verdict.behaviour_verdict.__doc__ or ""
    assert "upstream-by-behaviour" in doc and "old base" in doc and "without the patch" in doc
    state_py = (REPO / "overlay" / "maintain" / "rebase" / "state.py").read_text()
    places = {"docs/rebase/README.md": (REBASE_GUIDE, "`overlay/maintain/rebase/verdict.py:behaviour_verdict`"),
              "overlay/maintain/rebase/__init__.py": (rebase.__doc__ or "", "verdict.behaviour_verdict"),
              "overlay/maintain/rebase/state.py": (state_py, "verdict.behaviour_verdict")}
    for path, (text, pointer) in places.items():
        assert pointer in text, f"{path} does not point at {pointer}"
        said = RULE.search(" ".join(text.split()))
        assert not said, f"{path} restates the rule ({said[0]!r}): point at verdict.behaviour_verdict"


def test_the_matrix_cells_are_the_guides_and_passing_without_it_is_not_upstream() -> None:
    """The matrix's "passes without it" was glossed "(upstream)" in matrix.py and the guide: another
    meaning of the word than the rebase's, which also needs the tests to fail on the old base."""
    from overlay.maintain.rebase import matrix

    table = section(REBASE_GUIDE, "## `make patch-tests-matrix").split("| cell | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = dict(re.findall(r"(?m)^\| ([a-z' ]+) \| (.*) \|$", table))
    assert list(rows) == list(matrix.VERDICTS)
    doc = " ".join((matrix.__doc__ or "").split())
    for where, meaning in (("docs/rebase/README.md", rows["passes without it"]),
                           ("matrix.py", doc.split("``passes without it``", 1)[1].split("``passes with", 1)[0])):
        assert "(upstream)" not in meaning, f"{where}: 'passes without it' is not the rebase's upstream"
        assert "upstream-by-behaviour" in meaning, f"{where}: say how it differs from upstream-by-behaviour"


# -- failkind's rules: overlay.maintain.rebase.failkind.RULES -----------------------------------

def test_the_rebase_guide_shows_failkinds_rules_as_the_code_has_them() -> None:
    assert failkind.rules_table() in REBASE_GUIDE
    assert "RULES" in failkind.__doc__ and not re.search(r"(?m)^\d\. ", failkind.__doc__)


# -- the fetch-and-verify story: docs/build/README.md, "Fetching and verifying a release" --------

STORY = "build/README.md#fetching-and-verifying-a-release"


def test_the_verify_story_is_told_once_and_linked() -> None:
    guides = {p: p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
                                         *sorted((REPO / "docs").glob("*/README.md"))]}
    build = REPO / "docs" / "build" / "README.md"
    assert "\n## Fetching and verifying a release\n" in guides[build]
    for path, text in guides.items():
        if path != build:
            for words in ("quarantine", "--dry-run --report", "VLLM_TARGET_DEVICE=empty"):
                assert words not in text, f"{path.relative_to(REPO)} tells the verify story ({words!r}): link {STORY}"
    for path in (REPO / "README.md", REPO / "docs" / "ARCHITECTURE.md", REPO / "docs" / "rebase" / "README.md"):
        assert STORY in guides[path], f"{path.relative_to(REPO)} does not link to {STORY}"
