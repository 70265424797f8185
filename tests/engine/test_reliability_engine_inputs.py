"""Issue 25 items 5 and (b) for the engine tools: ``engine-check --variants/--variant`` and every ``--out``
checked before anything runs (one line, exit 2; no FileNotFoundError / NotADirectoryError)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overlay.cli import main


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize(("how", "words"), [
    ("missing", "no such folder"),
    ("a-file", "is a file, not a folder"),
    ("empty", "no variants.json in it: not engine-variants' output"),
    ("wrong-folder", "no 'variants' table"),
    ("tarball-missing", "variant minus-x: "),
])
def test_variants_folder_that_is_not_engine_variants_output(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            how: str, words: str) -> None:
    """Issue 25 item 5: ``engine-check --variants DIR`` with DIR missing, a file, empty, the wrong folder."""
    d = tmp_path / "variants"
    if how == "a-file":
        d.write_text("x")
    elif how != "missing":
        d.mkdir()
    if how == "wrong-folder":
        (d / "variants.json").write_text(json.dumps({"cells": {}}))
    if how == "tarball-missing":
        (d / "variants.json").write_text(json.dumps(
            {"variants": {"minus-x": {"case": "dcp2", "expect": "mismatch", "symptom": "s"}}}))
    line = _one_line(capsys, ["engine-check", "--out", str(tmp_path / "out"), "--variants", str(d)])
    assert str(d) in line and words in line and (how != "tarball-missing" or "minus-x.tar.gz: no such file" in line)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["missing", "not-a-tarball"])
def test_variant_tarball_missing_or_not_one(tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str) -> None:
    """Issue 25 item 5: ``engine-check --variant missing.tar.gz``."""
    tar = tmp_path / "v.tar.gz"
    if how == "not-a-tarball":
        tar.write_text("not a tar")
    line = _one_line(capsys, ["engine-check", "--out", str(tmp_path / "out"), "--variant", str(tar)])
    assert line == f"error: --variant {tar}: " + ("no such file" if how == "missing"
                                                   else "not a tarball (make engine-variants writes them)")


@pytest.mark.parametrize("verb", ["engine-check", "bench-engine"])
def test_out_under_a_file_is_refused_first(tmp_path: Path, capsys: pytest.CaptureFixture[str], verb: str) -> None:
    """Issue 25 (b): ``engine-check --out`` / ``bench-engine --out`` under a file: one line, nothing started."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "out"
    line = _one_line(capsys, [verb, "--out", str(out), "--server-cmd", "false"] if verb == "bench-engine"
                     else [verb, "--out", str(out)])
    assert line == f"error: --out {out}: {tmp_path / 'afile'} is a file, not a folder"
