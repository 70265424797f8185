"""Issue 25, shared cause (b) in the regression: every output path is checked before a request is sent,
and a recorded baseline never loses one profile to another or takes a failed check's numbers.

Items 3 (``--record-differential``/``--record-baseline`` whose parent is a file, that is a folder, or
that cannot be written), 18 (two ``--baseline-for`` with one name) and 19 (a baseline recorded from a
run whose acceptance collapsed).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from regress_helpers import make_profile, run_cli
from test_regress_differential import DIFF

REC_PROFILE = {"checks": ["acceptance", "latency"], "differential": DIFF["differential"],
               "checks_off": {"differential": "the reference", "gsm8k": "x", "long_context": "x"}}


def _bad_path(tmp_path: Path, how: str) -> Path:
    (tmp_path / "afile").write_text("x")
    if how == "parent-is-a-file":
        return tmp_path / "afile" / "out.json"
    if how == "is-a-folder":
        (tmp_path / "afolder").mkdir()
        return tmp_path / "afolder"
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    return ro / "out.json"


@pytest.mark.parametrize("flag", ["--record-differential", "--record-baseline"])
@pytest.mark.parametrize("how", ["parent-is-a-file", "is-a-folder", "unwritable"])
def test_an_output_that_cannot_be_written_is_refused_before_any_request(standin: Callable[..., Any],
                                                                       tmp_path: Path, flag: str, how: str) -> None:
    """Issue 25 item 3: the error came after every request, as a traceback; now first, one line, exit 2."""
    if how == "unwritable" and os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")  # /proc stands for it in test_checkpoint
    server = standin("healthy")
    bad = _bad_path(tmp_path, how)
    t0 = time.monotonic()
    run = run_cli(make_profile(tmp_path, **REC_PROFILE), tmp_path / "out", "--base-url", server.url, flag, str(bad))
    assert run.code == 2 and "Traceback" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {flag} {bad}: "), last
    assert ("is a file" if how == "parent-is-a-file" else "is a folder" if how == "is-a-folder"
            else "cannot write") in last
    assert "acceptance" not in run.stderr and time.monotonic() - t0 < 20  # no check ran
    assert (tmp_path / "out" / "verdict").read_text() == "harness\n"


def test_a_proc_path_is_refused_even_for_root(standin: Callable[..., Any], tmp_path: Path) -> None:
    """Issue 25 item 3 (unwritable, as root too): ``--record-differential /proc/ref.json``."""
    run = run_cli(make_profile(tmp_path, **REC_PROFILE), tmp_path / "out", "--base-url", standin("healthy").url,
                  "--record-differential", "/proc/ref.json")
    assert run.code == 2 and run.stderr.strip().splitlines()[-1].startswith(
        "error: --record-differential /proc/ref.json: cannot write in /proc"), run.stderr


def test_two_baseline_for_with_one_name_are_refused(tmp_path: Path) -> None:
    """Issue 25 item 18: ``--baseline-for /a/x.yaml --baseline-for /b/x.yaml`` wrote DIR/x.yaml twice."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "x.yaml").write_text(make_profile(tmp_path).read_text())
    run = run_cli(make_profile(tmp_path, **REC_PROFILE), tmp_path / "out", "--base-url", "http://127.0.0.1:9",
                  "--record-baseline", str(tmp_path / "dir"), "--baseline-for", str(tmp_path / "a" / "x.yaml"),
                  "--baseline-for", str(tmp_path / "b" / "x.yaml"))
    assert run.code == 2, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last == (f"error: --baseline-for {tmp_path / 'a' / 'x.yaml'} and --baseline-for "
                    f"{tmp_path / 'b' / 'x.yaml'} would both be written to {tmp_path / 'dir' / 'x.yaml'}: "
                    "record them into two folders")
    assert not (tmp_path / "dir").exists()


def test_a_failed_check_is_left_out_of_the_recorded_baseline(standin: Callable[..., Any], tmp_path: Path) -> None:
    """Issue 25 item 19: against a collapsing server the collapsed curve became the baseline; now the failed
    acceptance is left out (said aloud) and the target profile keeps its own curve."""
    profile = make_profile(tmp_path, **REC_PROFILE)
    own = yaml.safe_load(profile.read_text())["baseline"]["acceptance_per_position"]
    out = tmp_path / "recorded.yaml"
    run = run_cli(profile, tmp_path / "run", "--base-url", standin("collapse").url, "--record-baseline", str(out))
    assert run.code == 1 and run.step("acceptance")["status"] == "fail", run.stderr
    assert "record-baseline: acceptance left out: the check failed" in run.stderr
    assert run.step("record-baseline")["summary"] == f"wrote {out} (acceptance left out: failed)"
    base = yaml.safe_load(out.read_text())["baseline"]
    assert base["acceptance_per_position"] == own and "latency" in base["source"]
    assert "acceptance" not in base["source"]
