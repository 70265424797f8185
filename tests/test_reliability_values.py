"""Issue 35 item 4, *values become code or options*: a remote, ref or Make variable a user gives is
only ever a value: git never reads it as an option, the shell never runs it.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from overlay import cli
from overlay.build.pins import default_version
from overlay.errors import UsageError
from tests.test_cherry_pick import pick, setup  # noqa: F401  (the fixture)

REPO = Path(__file__).resolve().parent.parent
DEFAULT = default_version(REPO / "patches")


@pytest.mark.parametrize("how", ["remote", "VLLM_REMOTE"])
def test_a_remote_that_is_an_option_runs_no_command(setup, tmp_path: Path, monkeypatch, how: str) -> None:  # noqa: F811
    """Issue 35 item 4: ``VLLM_REMOTE='--upload-pack=touch M;'`` reached ``git fetch`` as an option and git ran
    ``touch M`` (then failed with "cannot fetch pull request 7"); now it is refused in one line, nothing runs."""
    root, _, _ = setup
    marker = tmp_path / "pwned"
    hostile = f"--upload-pack=touch {marker};"
    kw = {}
    if how == "VLLM_REMOTE":
        monkeypatch.setenv("VLLM_REMOTE", hostile)
    else:
        kw["remote"] = hostile
    with pytest.raises(UsageError, match=r"starts with '-', which git would read as an option"):
        from overlay.maintain.cherry_pick import cherry_pick
        from tests.rebasekit import BASE, FROM, fill

        cherry_pick(root, FROM, "7", fill_base=fill(BASE), work=tmp_path / "work" / f"cherry-pick-{FROM}",
                    today="2026-12-01", **kw)
    assert not marker.exists()
    assert not (tmp_path / "work" / "cherry-pick-0.1.0").exists()


def test_a_ref_that_is_an_option_is_refused(setup, tmp_path: Path) -> None:  # noqa: F811
    """Issue 35 item 4: a REF starting with '-' went into ``git fetch`` and ``git rev-parse`` argument lists."""
    root, remote, _ = setup
    with pytest.raises(UsageError, match=r"^REF '--output=x': starts with '-'"):
        pick(root, tmp_path, "--output=x", remote)


def test_operand_is_the_one_check() -> None:
    """Issue 35 item 4: the check every user value passes before it reaches git (new: there was none)."""
    from overlay.git import operand

    assert operand("https://github.com/vllm-project/vllm.git", "R") == "https://github.com/vllm-project/vllm.git"
    for bad in ("-x", "--upload-pack=sh", "", "a\nb"):
        with pytest.raises(UsageError):
            operand(bad, "R")


# --- Make variables ---------------------------------------------------------------------------

STUB = """#!{python}
import json, sys
if sys.argv[1:] == ["-c", "pass"]:
    sys.exit(0)
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


@pytest.fixture
def stub_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv whose python only records its arguments (one JSON list a line), stamps fresh."""
    venv, log = tmp_path / "venv", tmp_path / "argv.jsonl"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(STUB.format(python=sys.executable, log=str(log)))
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    for stamp in (".overlay-tool", f".overlay-build-{DEFAULT}"):
        (venv / stamp).write_text("")
    return venv, log


HOSTILE = "x'; touch {m}; echo '"  # breaks out of '...' quoting too
BACKTICK = "`touch {m}`"


@pytest.mark.parametrize(
    ("target", "variables", "expect"),
    [
        pytest.param("cherry-pick", {"REF": HOSTILE, "NAME": BACKTICK, "AFTER": "a;touch {m}"},
                     ["cherry-pick", "--vllm", DEFAULT, "--after", "a;touch {m}", "--name", BACKTICK, "--", HOSTILE],
                     id="cherry-pick-REF-NAME-AFTER"),
        pytest.param("regress", {"PROFILE": "p;touch {m}", "OUT": "o;touch {m}", "BASE_URL": "http://h|touch {m}",
                                 "ARGS": "--skip gsm8k;touch {m}"},
                     ["regress", "--profile", "p;touch {m}", "--out", "o;touch {m}", "--base-url", "http://h|touch {m}",
                      "--skip", "gsm8k;touch", "{m}"], id="regress-PROFILE-OUT-BASE_URL-ARGS"),
        pytest.param("workspace-plan", {"PROFILE": "&& touch {m}"}, ["workspace-plan", "--profile", "&& touch {m}"],
                     id="workspace-plan-PROFILE"),
        pytest.param("device-stage", {"NAME": "e;touch {m}", "EXTRA": "a==1;touch"},
                     ["device-stage", "--vllm", DEFAULT, "--name", "e;touch {m}", "--extra", "a==1;touch"],
                     id="device-stage-NAME-EXTRA"),
        pytest.param("regress-verdicts", {"ROOT": "r;touch {m}", "EXPECT": "a=pass"},
                     ["regress-verdicts", "--", "r;touch {m}", "a=pass"], id="regress-verdicts-ROOT"),
        pytest.param("rebase", {"NO_TESTS": "1", "TO": "0.31.0"},
                     ["rebase", "--vllm", DEFAULT, "--to", "0.31.0", "--no-tests"], id="rebase-plain"),
    ],
)
def test_make_variables_reach_the_verb_as_one_argument(stub_venv, tmp_path: Path, target: str,
                                                       variables: dict[str, str], expect: list[str]) -> None:
    """Issue 35 item 4: Make variables (TO, REF, PROFILE, NAME, ...) went into the recipes unquoted (or in
    '...' that a quote in the value breaks out of): ``make rebase 'TO=9.9.9;touch M'`` ran ``touch M`` in
    the shell. Now each reaches the verb as exactly the argument(s) given, and nothing else runs."""
    venv, log = stub_venv
    marker = tmp_path / "pwned"
    args = [f"{k}={v.format(m=marker)}" for k, v in variables.items()]
    proc = subprocess.run(["make", "--no-print-directory", f"VENV={venv}", f"PYTHON={venv}/bin/python", target,
                           *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert not marker.exists(), proc.stdout + proc.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    assert calls, proc.stdout + proc.stderr
    assert calls[-1][:2] == ["-m", "overlay"]
    assert calls[-1][2:] == [a.format(m=marker).replace("$$", "$") for a in expect]


@pytest.mark.parametrize(
    ("target", "variable", "value"),
    [("rebase", "TO", "9.9.9;touch {m}"), ("rebase-continue", "TO", "$$(touch {m})"),
     ("status", "VLLM", "0.28.0;touch {m}"), ("build", "VLLM", "0.28.0'x")],
)
def test_make_refuses_a_version_that_is_not_x_y_z(stub_venv, tmp_path: Path, target: str, variable: str,
                                                   value: str) -> None:
    """Issue 35 item 4: TO and VLLM went into the shell (and VLLM into a stamp file's name) as given; a
    ``;`` in them ran the rest. Now make checks both as x.y.z before any recipe: one line, exit 2."""
    venv, log = stub_venv
    marker = tmp_path / "pwned"
    given = value.format(m=marker)
    proc = subprocess.run(["make", "--no-print-directory", f"VENV={venv}", target, f"{variable}={given}"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and not marker.exists() and not log.exists()
    shown = given.replace("$$", "$")
    assert proc.stderr.splitlines() == [
        f"Makefile:{proc.stderr.split(':')[1]}: *** {variable}={shown}: not a release version like 0.30.0.  Stop."]


def test_make_rebase_with_code_in_TO_is_one_line(monkeypatch, capsys) -> None:
    """Issue 35 item 4: ``make rebase 'TO=9.9.9;echo pwned'`` ran ``echo pwned`` and exited 0 (the rebase onto
    9.9.9 was started first). Now TO reaches the verb whole, and the verb checks it is x.y.z before it
    fetches anything: one line, exit non-zero."""
    import overlay.build.fetch as fetch

    def no_fetch(*a, **k):
        raise AssertionError("fetched before checking TO")

    monkeypatch.setattr(fetch, "fetch_wheel", no_fetch)
    monkeypatch.setattr(fetch, "fetch_release", no_fetch)
    rc = cli.main(["--patches", str(REPO / "patches"), "rebase", "--to", "9.9.9;echo pwned", "--no-tests"])
    err = capsys.readouterr().err
    assert rc != 0
    assert err.splitlines() == ["error: TO (--to): '9.9.9;echo pwned' is not a release version like 0.30.0"]


def test_make_rebase_through_make_exits_non_zero(tmp_path: Path) -> None:
    """Issue 35 item 4: ``make rebase 'TO=9.9.9;echo pwned'`` printed ``pwned`` and exited 0; now make stops
    before any recipe, with one line."""
    env = {**os.environ, "VLLM_OVERLAY_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.overlay-tool", "rebase",
                           "TO=9.9.9;echo pwned"], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.endswith(": *** TO=9.9.9;echo pwned: not a release version like 0.30.0.  Stop.\n")
    assert len(proc.stderr.splitlines()) == 1


def test_no_workflow_puts_an_expression_into_a_shell_line() -> None:
    """Issue 35 item 4: ci/regress.yml's workflow input reaches ``make regress`` only through an env var,
    quoted (``PROFILE="$PROFILE"``), never as ``${{ ... }}`` inside a ``run:`` line (held already where
    this branch began; kept as a guard)."""
    import yaml

    for path in sorted((REPO / "ci").glob("*.yml")):
        doc = yaml.safe_load(path.read_text())
        for job in doc["jobs"].values():
            for step in job["steps"]:
                assert "${{" not in step.get("run", ""), f"{path.name}: {step.get('name')}"
    regress = yaml.safe_load((REPO / "ci" / "regress.yml").read_text())
    runs = [s["run"] for s in regress["jobs"]["regress"]["steps"] if "run" in s]
    assert 'make regress PROFILE="$PROFILE" OUT=regress-report' in runs
