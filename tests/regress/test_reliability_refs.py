"""Issue 25 item 9: the differential check's reference comes from one place: a server or a recording."""

from __future__ import annotations

from pathlib import Path

import pytest
from regress_helpers import run_cli
from test_regress_differential import _profile


@pytest.mark.parametrize("how", ["env", "flag"])
def test_ref_url_and_ref_file_together_are_refused(tmp_path: Path, how: str) -> None:
    """Issue 25 item 9: ``REF_URL=<server> ... --ref-file ref.json`` (and ``make regress``, which passes
    ``--ref-url $(REF_URL)``) no longer judges silently against the server: refused, nothing run."""
    args = ["--base-url", "http://127.0.0.1:9", "--ref-file", str(tmp_path / "ref.json")]
    env = {"REF_URL": "http://127.0.0.1:8"} if how == "env" else {"REF_URL": ""}
    if how == "flag":
        args += ["--ref-url", "http://127.0.0.1:8"]
    run = run_cli(_profile(tmp_path), tmp_path / "out", *args, env=env)
    assert run.code == 2 and (tmp_path / "out" / "verdict").read_text() == "harness\n"
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --ref-url" if how == "flag" else "error: REF_URL (environment)"), run.stderr
    assert "http://127.0.0.1:8 and --ref-file" in last and "give one" in last
