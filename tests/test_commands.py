"""The command line's rules, held: each verb found from its name, the standard library only at import,
one error path, and which Python the Makefile runs a verb under.

``overlay/commands/__init__.py`` lists where each verb lives and which run on the device
(``DEVICE_VERBS``); the Makefile's header says when a target calls ``$(OVERLAY)`` and when a bare
``python3 -m overlay``, naming that list. Both are prose a newcomer reads, so each is checked here
against what the code does.
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from overlay import cli, commands

REPO = Path(__file__).resolve().parent.parent
MAKEFILE = (REPO / "Makefile").read_text()


def documented_table() -> list[tuple[str, list[str]]]:
    rows = re.findall(r"(?m)^- ``([a-z_]+)\.py``: ([a-z, -]+)$", commands.__doc__ or "")
    return [(module, [v.strip() for v in verbs.split(",")]) for module, verbs in rows]


def real_table() -> list[tuple[str, list[str]]]:
    """Each module of ``MODULES`` with the verbs its ``configure_parser`` adds, in order."""
    rows = []
    for name in commands.MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"overlay.commands.{name}").configure_parser(sub)
        rows.append((name, list(sub.choices)))
    return rows


def test_the_verb_table_says_where_every_verb_lives() -> None:
    assert documented_table() == real_table()
    assert [v for _, verbs in real_table() for v in verbs] == list(cli.verbs())


CHECK_IMPORTS = """
import sys
before = set(sys.modules)
{code}
new = set(sys.modules) - before
print("\\n".join(sorted(n for n in new if n.split(".")[0] not in sys.stdlib_module_names | {{"overlay"}})))
"""


@pytest.mark.parametrize("code", [f"import overlay.commands.{m}" for m in commands.MODULES]
                         + ["from overlay import cli; cli.parser()"])
def test_the_commands_import_only_the_standard_library(code: str) -> None:
    """What ``python3 -m overlay engine-check`` needs on the device, which has no venv: importing a
    commands module, and building the whole parser, loads nothing outside the standard library."""
    out = subprocess.run([sys.executable, "-c", CHECK_IMPORTS.format(code=code)], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=60).stdout.split()
    assert out == [], f"{code}: imports {', '.join(out)} at import time (import it inside the handler)"


def test_only_the_cli_prints_errors() -> None:
    for path in sorted((REPO / "overlay" / "commands").glob("*.py")):
        assert not re.search(r"print\(f?[\"']error", path.read_text()), f"{path.name} prints error: itself"


def test_cherry_pick_without_a_ref_takes_the_one_error_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["cherry-pick"]) == 1
    assert capsys.readouterr().err == "error: cherry-pick needs REF (a PR number, a commit or a patch file)\n"


def recipes(makefile: str = MAKEFILE) -> dict[str, tuple[str, str]]:
    """target -> (its prerequisites, its recipe), for the targets ``make help`` lists (a name of letters,
    digits, ``_`` and ``-``, as its awk reads it)."""
    out = {}
    for m in re.finditer(r"(?m)^([A-Za-z0-9_-]+):([^=\n#]*)##[^\n]*\n((?:\t[^\n]*\n)*)", makefile):
        out[m[1]] = (m[2], m[3])
    return out


def test_a_target_named_with_digits_has_its_recipe_read() -> None:
    makefile = MAKEFILE + "\n.PHONY: k8s-check2\nk8s-check2: $(TOOL_STAMP) ## digits\n\t$(OVERLAY) k8s-check2\n"
    assert recipes(makefile)["k8s-check2"] == (" $(TOOL_STAMP) ", "\t$(OVERLAY) k8s-check2\n")


def test_every_target_make_help_lists_is_phony() -> None:
    """.PHONY was declared by hand on scattered lines, untested: a target named like a path that exists
    (``dist``, ``docs``, ``kernel-sources``) and left off them is "up to date" for make, which then runs
    nothing and exits 0."""
    phony = {name for line in re.findall(r"(?m)^\.PHONY:(.*)$", MAKEFILE) for name in line.split()}
    listed = re.findall(r"(?m)^([A-Za-z0-9_.-]+):(?!=)[^\n]*## ", MAKEFILE)
    assert len(listed) >= len(cli.verbs())
    assert [t for t in listed if t not in phony] == [], "add them to a .PHONY line"
    assert ".PHONY line" in MAKEFILE.split("\n.PHONY", 1)[0], "the Makefile's header says it"


def test_the_makefile_header_says_which_python_runs_each_verb() -> None:
    """The device verbs were written in the header, in this test and (wrongly) in ``commands/engine.py``;
    ``commands.DEVICE_VERBS`` is the one list, the header names it and its verbs, the recipes follow it."""
    header = " ".join(line.lstrip("#").strip() for line in MAKEFILE.split("\n.PHONY", 1)[0].splitlines())
    named = re.search(r"overlay/commands/__init__\.py:DEVICE_VERBS \(([^)]*)\)", header)
    assert named, "the Makefile's header names overlay/commands/__init__.py:DEVICE_VERBS (its verbs)"
    assert [v.strip() for v in named[1].split(",")] == list(commands.DEVICE_VERBS), named[1]
    assert set(commands.DEVICE_VERBS) <= set(cli.verbs())
    bare = {t for t, (_, recipe) in recipes().items() if "$(call q,PYTHON) -m overlay" in recipe}
    assert bare == set(commands.DEVICE_VERBS)
    for target, (prereqs, recipe) in recipes().items():
        if target in bare:
            assert "$(TOOL_STAMP)" not in prereqs and "$(BUILD_STAMP)" not in prereqs, target
            assert "$(OVERLAY)" not in recipe, target
        elif "$(OVERLAY)" in recipe:
            assert "$(TOOL_STAMP)" in prereqs or "$(BUILD_STAMP)" in prereqs, f"{target}: $(OVERLAY) without the venv"


def test_the_device_scripts_call_real_verbs_and_the_rule_names_the_others() -> None:
    """A script under ``scripts/device-run.sh`` calls ``python3 -m overlay <verb>`` itself, not through
    make; one outside ``DEVICE_VERBS`` is named where the rule says why a script may."""
    called = {verb for path in sorted((REPO / "scripts").glob("device-*.sh"))
              for verb in re.findall(r"python3 -m overlay ([a-z0-9-]+)", path.read_text())}
    assert set(commands.DEVICE_VERBS) <= called <= set(cli.verbs()), called - set(cli.verbs())
    rule = (REPO / "overlay" / "commands" / "__init__.py").read_text().split("DEVICE_VERBS: tuple", 1)[1]
    others = sorted(v for v in called - set(commands.DEVICE_VERBS) if f"``{v}``" not in rule)
    assert others == [], f"scripts/device-*.sh call {others}: the DEVICE_VERBS docstring says why a script may"


def verbs_run(recipe: str) -> list[str]:
    """The verbs a recipe runs: what follows ``$(OVERLAY)`` or ``-m overlay`` (and ``--patches X``)."""
    return re.findall(r"(?:\$\(OVERLAY\)|-m overlay)(?: --patches \S+)? ([A-Za-z0-9_-]+)", recipe)


def test_a_target_named_after_a_verb_runs_that_verb() -> None:
    """``make <verb>`` runs ``overlay <verb>``: nothing held it, so a target could call another verb (or
    none) under a verb's name and every other test of the Makefile would still pass."""
    verbs = set(cli.verbs())
    wrong = {t: verbs_run(r) for t, (_, r) in recipes().items() if t in verbs and t not in verbs_run(r)}
    assert wrong == {}, wrong
    mixed_up = MAKEFILE + "\nstatus: $(TOOL_STAMP) ## x\n\t$(OVERLAY) patch-lint\n"
    assert "status" not in verbs_run(recipes(mixed_up)["status"][1])  # the check sees a target that runs another
