"""The README, the Makefile and the CLI agree: every documented target exists, every target is documented.

A newcomer reads the README's "Make targets" table and "Where to look" table; ``make help`` lists
the Makefile's targets; the Makefile calls the CLI's verbs. A target added without a README row, a
README row for a target that went, a verb the Makefile calls that the CLI lacks, or a guide the
README points to that is not there, fails here; so does a file the "Extending" list names that is not
there, and a README line over 200 characters (a cell that wants its guide).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from overlay import cli
from tests.test_commands import verbs_run

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
MAKEFILE = (REPO / "Makefile").read_text()


TARGET = r"[a-zA-Z0-9_-]+"  # a target's name, as ``make help``'s awk reads it: letters, digits, _ and -


def make_targets(makefile: str = MAKEFILE) -> set[str]:
    """The targets ``make help`` lists (those with a ``## help`` text)."""
    return set(re.findall(rf"(?m)^({TARGET}):[^=\n]*##", makefile)) - {"help"}


def readme_table_targets(readme: str = README) -> set[str]:
    section = readme.split("## Make targets", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(rf"`({TARGET})`", row)}


def test_every_target_has_a_readme_row_and_every_row_a_target() -> None:
    assert make_targets() == readme_table_targets()


def readme_job_targets(readme: str = README) -> list[str]:
    """The Make targets the "Where to look" rows name (its second column), one list over every job."""
    section = readme.split("## Where to look", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    return [name for cells in rows[1:] for name in re.findall(rf"`({TARGET})`", cells[2])]


def test_every_target_belongs_to_one_job() -> None:
    """``make help`` (and ``python -m overlay --help``, whose verbs are the targets: below) agree with the job
    table: each target in exactly one job's row."""
    named = readme_job_targets()
    twice = sorted({n for n in named if named.count(n) > 1})
    assert not twice, f"a target in two jobs: {twice}"
    assert set(named) == make_targets(), (f"jobs lack {sorted(make_targets() - set(named))}, "
                                          f"name no target {sorted(set(named) - make_targets())}")


def test_the_job_table_keeps_each_cell_on_one_line() -> None:
    """A job is one line: a row continued on the next (an empty first cell) would be a job that wants its guide."""
    section = README.split("## Where to look", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows and all(line.split("|")[1].strip() for line in rows), "a 'Where to look' row runs over a line"
    assert len(readme_job_targets(README.replace("| `build`, `test`,", "| `build`, `bogus`, `test`,"))) == \
        len(readme_job_targets()) + 1


def test_make_commands_in_the_readme_name_real_targets() -> None:
    for target in re.findall(rf"`make ({TARGET})", README):
        assert target in make_targets() | {"help"}, f"README: make {target}: no such target"


def test_the_makefile_calls_only_verbs_the_cli_has() -> None:
    verbs = set(verbs_run(MAKEFILE))
    assert verbs and verbs <= set(cli.verbs()), verbs - set(cli.verbs())


def test_every_verb_has_its_make_target() -> None:
    """The CLI's verbs and the Makefile's targets are one list (cherry-pick-continue is cherry-pick --continue)."""
    assert set(cli.verbs()) <= make_targets(), set(cli.verbs()) - make_targets()
    extra = make_targets() - set(cli.verbs())
    assert extra == {"test", "test-long", "lint", "cherry-pick-continue"}, extra


def test_a_target_named_with_digits_is_listed_and_needs_its_row(tmp_path: Path) -> None:
    """``make help``'s awk once read only letters, ``_`` and ``-``: a target named with a digit would be
    left out of the listing and of these tests, which read names the same way."""
    extra = tmp_path / "digits.mk"
    extra.write_text(".PHONY: k8s-check2\nk8s-check2: ## a target named with digits\n\t@true\n")
    listed = subprocess.run(["make", "--no-print-directory", "-f", "Makefile", "-f", str(extra), "help"], cwd=REPO,
                            capture_output=True, text=True, check=True, timeout=60).stdout
    assert re.search(r"(?m)^  k8s-check2 +a target named with digits$", listed), listed
    assert "k8s-check2" in make_targets(MAKEFILE + extra.read_text())
    first = "| `build` | `make build`"
    assert "k8s-check2" in readme_table_targets(README.replace(first, "| `k8s-check2` | `make k8s-check2` |\n" + first))


def test_the_extending_list_names_real_files_and_symbols() -> None:
    """Each extension point starts with its one place; every file (and ``file:SYMBOL``) the list names is there."""
    section = README.split("## Extending", 1)[1].split("\n## ", 1)[0]
    points = re.findall(r"(?m)^- \*\*([^*]+)\*\*: [^`\n]*`([^`]+)`", section)
    assert len(points) >= 10 and {"a patch", "a regress profile", "a regress check"} <= {p for p, _ in points}
    named = re.findall(r"`((?:overlay|tests|docs|patches|scripts)/[^`*\s]*)`", section)
    assert [p for p, where in points if where not in named] == [], "an extension point's first file is its place"
    for where in (n for n in named if "<" not in n):  # a pattern (patches/<release>/) names no one file
        path, _, symbol = where.partition(":")
        assert (REPO / path).exists(), f"README Extending: {path} is not there"
        if symbol:
            assert re.search(rf"\b{re.escape(symbol)}\b", (REPO / path).read_text()), f"{path} has no {symbol}"


def test_the_readme_fits_a_screen_per_job() -> None:
    """Issue 52: at most about 160 lines; dated history, measurements and device lore live in docs/records/ and
    the guides."""
    assert len(README.splitlines()) <= 165, len(README.splitlines())


LONGEST = 200  # characters: a longer line is a table cell (or a paragraph) that wants its guide


def test_no_readme_line_is_longer_than_200_characters() -> None:
    """A newcomer reads the README in an editor and a diff as well as rendered: a table cell of 900 characters
    was a guide's paragraph in the wrong place (move it to the guide its row links to)."""
    long = [(n, len(line)) for n, line in enumerate(README.splitlines(), 1) if len(line) > LONGEST]
    assert long == [], f"README.md lines (number, length) over {LONGEST} characters: {long}"


def test_the_guides_the_readme_points_to_exist() -> None:
    for path in set(re.findall(r"`(docs/[^`*<>]+?)`", README)):
        assert (REPO / path).exists(), f"README points to {path}, which is not there"
    assert (REPO / "docs" / "ARCHITECTURE.md").is_file()


def test_one_default_release_everywhere() -> None:
    """patches/DEFAULT is the default of the CLI (read at run time), the Makefile (read by make) and the
    Dockerfile's VLLM_VERSION (which cannot read files: it must say the same)."""
    from overlay.build.pins import default_version

    default = default_version(REPO / "patches")
    assert (REPO / "patches" / default / "pin.toml").is_file()
    assert "DEFAULT_VLLM := $(shell head -n 1 patches/DEFAULT)\nVLLM ?= $(DEFAULT_VLLM)" in MAKEFILE
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert f"ARG VLLM_VERSION={default}\n" in dockerfile
    ns = cli.parser().parse_args(["status"])
    assert ns.vllm is None  # resolved from patches/DEFAULT in cli.main
