"""The README, the Makefile and the CLI agree: every documented target exists, every target is documented.

A newcomer reads the README's "Make targets" table and "Where to look" table; ``make help`` lists
the Makefile's targets; the Makefile calls the CLI's verbs. A target added without a README row, a
README row for a target that went, a verb the Makefile calls that the CLI lacks, or a guide the
README points to that is not there, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

from overlay import cli

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
MAKEFILE = (REPO / "Makefile").read_text()


def make_targets() -> set[str]:
    """The targets ``make help`` lists (those with a ``## help`` text)."""
    return set(re.findall(r"(?m)^([a-zA-Z_-]+):[^=\n]*##", MAKEFILE)) - {"help"}


def readme_table_targets() -> set[str]:
    section = README.split("## Make targets", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([a-z-]+)`", row)}


def test_every_target_has_a_readme_row_and_every_row_a_target() -> None:
    assert make_targets() == readme_table_targets()


def test_make_commands_in_the_readme_name_real_targets() -> None:
    for target in re.findall(r"`make ([a-z][a-z-]+)", README):
        assert target in make_targets() | {"help"}, f"README: make {target}: no such target"


def test_the_makefile_calls_only_verbs_the_cli_has() -> None:
    verbs = set(re.findall(r"(?:\$\(OVERLAY\)|-m overlay)(?: --patches \S+)? ([a-z-]+)", MAKEFILE))
    assert verbs and verbs <= set(cli.verbs()), verbs - set(cli.verbs())


def test_every_verb_has_its_make_target() -> None:
    """The CLI's verbs and the Makefile's targets are one list (cherry-pick-continue is cherry-pick --continue)."""
    assert set(cli.verbs()) <= make_targets(), set(cli.verbs()) - make_targets()
    extra = make_targets() - set(cli.verbs())
    assert extra == {"test", "lint", "cherry-pick-continue"}, extra


def test_the_extending_table_names_real_files_and_symbols() -> None:
    section = README.split("## Extending", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]
    assert len(rows) >= 5
    for row in rows:
        where = row.split("|")[2]
        path, _, symbol = re.search(r"`([^`]+)`", where).group(1).partition(":")
        assert (REPO / path).exists(), f"README Extending: {path} is not there"
        if symbol:
            assert re.search(rf"\b{re.escape(symbol)}\b", (REPO / path).read_text()), f"{path} has no {symbol}"


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
    assert "VLLM ?= $(shell head -n 1 patches/DEFAULT)" in MAKEFILE
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert f"ARG VLLM_VERSION={default}\n" in dockerfile
    ns = cli.parser().parse_args(["status"])
    assert ns.vllm is None  # resolved from patches/DEFAULT in cli.main
