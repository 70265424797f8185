"""Issue 53 cause 1: the project's JSON records read one bounded, shape-checked way (``overlay.jsonfile``).

Each reader the issue names (the liveness lines file, ``engine-check --rejudge``, ``engine-plot``, the device's
``device-requires.json``, the resolution cache, the records under ``docs/records/engine/``) is given the hostile
documents of the sweep: nesting deeper than the parser's recursion, a link to ``/dev/zero``, a FIFO, NaN and
Infinity, a wrong type where the code after the parse relies on one, a file over the size limit. Each is one
line naming the file (or, for a cache, a warning and a fresh resolution), never a traceback, a hang or the
machine's memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from overlay import jsonfile
from overlay.cli import main
from overlay.device.settings import DeviceStageError
from overlay.errors import OverlayError
from tests.wheelkit import make_release, make_wheel

REPO = Path(__file__).resolve().parent.parent
DEEP = "[" * 200_000 + "]" * 200_000  # RecursionError in json.loads


def _hostile(path: Path, how: str, wrong: str) -> None:
    """Make ``path`` the hostile input ``how``; ``wrong`` is the reader's own wrong-shape document."""
    if how == "deep":
        path.write_text(DEEP)
    elif how == "deep-in-an-object":
        path.write_text('{"a": ' + "[" * 100 + "]" * 100 + "}")  # within the recursion limit, over DEPTH
    elif how == "dev-zero":
        path.symlink_to("/dev/zero")
    elif how == "fifo":
        os.mkfifo(path)  # nothing ever writes: a reader that opens it plainly waits forever
    elif how == "folder":
        path.mkdir()
    elif how == "too-large":
        path.write_text(json.dumps({"pad": "x" * 2048}))
    elif how == "wrong-shape":
        path.write_text(wrong)


HOW = ["deep", "deep-in-an-object", "dev-zero", "fifo", "folder", "too-large", "wrong-shape"]


def _one_line(exc: BaseException, path: Path) -> str:
    line = str(exc)
    assert "\n" not in line and str(path) in line, line
    return line


@pytest.fixture(autouse=True)
def _small_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonfile, "LIMIT", 1024)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", HOW)
def test_the_liveness_lines_file(tmp_path: Path, how: str) -> None:
    """Cause 1: ``engine-check --liveness F`` (``load_lines``)."""
    from overlay.engine.inputs import EngineCheckError
    from overlay.engine.liveness_lines import load_lines

    path = tmp_path / "liveness.json"
    _hostile(path, how, json.dumps({"format": 1, "vllm": "x", "series": ["a.patch"],
                                    "lines": {"a.patch": {"vllm/a.py": [1, "two"]}}}))
    with pytest.raises(EngineCheckError) as caught:
        load_lines(path, "x")
    line = _one_line(caught.value, path)
    assert line.startswith(f"--liveness {path}: ")
    if how == "wrong-shape":
        assert "lines.a.patch.vllm/a.py[1]: expected an integer, got 'two'" in line


def _results(case: dict[str, object] | None = None, **more: object) -> str:
    rec = {"name": "dcp2", "status": "ok", "case": case or {"name": "dcp2", "role": "check", "dcp": 2}, **more}
    return json.dumps({"meta": {}, "summary": {"verdict": "pass"}, "cases": [rec]})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", HOW)
def test_engine_check_rejudge(tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str) -> None:
    """Cause 1: ``engine-check --rejudge`` of a ``results.json`` (``check.rejudge``): one line, exit 2."""
    out = tmp_path / "out"
    out.mkdir()
    _hostile(out / "results.json", how, _results({"name": "dcp2", "role": "check", "dcp": "two"}))
    assert main(["engine-check", "--rejudge", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {out / 'results.json'}: "), err
    if how == "wrong-shape":
        assert "cases[0].case.dcp: expected an integer, got 'two'" in err[0]


@pytest.mark.parametrize(("name", "words"), [("../../../etc/passwd", "holds a /"), ("..", "the one above it")])
def test_a_record_name_that_leaves_the_results_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 name: str, words: str) -> None:
    """Cause 1 (and 2: a name joined into a path): a record's name names its ``.json`` and ``.log`` beside
    ``results.json``; one that leaves the folder is refused, nothing read through it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(_results(name=name))
    assert main(["engine-check", "--rejudge", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cases[0]: its name" in err and words in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", HOW)
def test_engine_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str) -> None:
    """Cause 1: ``engine-plot RESULTS`` (``plot.bars``): one line, exit 1, no plot."""
    path = tmp_path / "results.json"
    _hostile(path, how, _results(diff={"dense_max_abs": "big"}))
    assert main(["engine-plot", str(path), "--out", str(tmp_path / "p.png")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: "), err
    assert not (tmp_path / "p.png").exists()
    if how == "wrong-shape":
        assert "cases[0].diff.dense_max_abs: expected a number, got 'big'" in err[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", [*HOW, "nan", "infinity"])
def test_the_device_requires_record(tmp_path: Path, how: str) -> None:
    """Cause 1: ``device-stage --device-requires F`` (``read_device_requires``)."""
    from overlay.device.requirements import read_device_requires

    path = tmp_path / "device-requires.json"
    if how in ("nan", "infinity"):
        path.write_text('{"packages": {}, "format": ' + ("NaN" if how == "nan" else "-Infinity") + "}")
    else:
        _hostile(path, how, json.dumps({"packages": {"a": {"version": 1.0, "requires": []}}}))
    with pytest.raises(DeviceStageError) as caught:
        read_device_requires(path, {"a": "1.0"})
    line = _one_line(caught.value, path)
    assert any(words in line for words in ("not a record of scripts/device-requires.py", "is a", "larger than",
                                           "reached through a symbolic link out of"))
    if how in ("nan", "infinity"):
        assert ("NaN" if how == "nan" else "-Infinity") + " is not a number JSON allows" in line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", [*HOW, "nan"])
def test_the_resolution_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str) -> None:
    """Cause 1: a cached resolution (``load_resolution``) is a warning and a fresh resolution, whatever it holds."""
    from overlay.device.resolution_cache import load_resolution

    path = tmp_path / "k.json"
    if how == "nan":
        path.write_text('{"format": 1, "key": "k", "rounds": NaN}')
    else:
        _hostile(path, how, json.dumps({"format": 1, "key": "k", "rounds": 1, "restored": [], "required_by": {},
                                        "wheels": [7], "dropped": []}))
    assert load_resolution(path, "k") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and err[0].endswith("resolving again"), err


def _status_repo(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    wheel = make_wheel(tmp_path, {"vllm/a.py": b"a = 1\n"})
    root = make_release(tmp_path, wheel)
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
    records = tmp_path / "docs" / "records" / "engine"
    good = records / "1xh200-2026-12-06" / "results.json"
    good.parent.mkdir(parents=True)
    good.write_text(json.dumps({"meta": {"vllm": "0.28.0+ovlx", "started": "2026-12-06T10:00:00"},
                                "summary": {"verdict": "pass"},
                                "cases": [{"name": "ref-dcp1", "verdict": "reference",
                                           "case": {"name": "ref-dcp1", "dcp": 1}}]}))
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "VLLM_OVERLAY_CACHE": str(cache)}
    return root, records, env


BAD_RECORDS: dict[str, Callable[[Path], None]] = {
    "deep": lambda p: p.write_text(DEEP),
    "dev-zero": lambda p: p.symlink_to("/dev/zero"),
    "dcp-a-string": lambda p: p.write_text(json.dumps(
        {"meta": {"vllm": "0.28.0"}, "cases": [{"name": "c", "case": {"name": "c", "dcp": "x"}}]})),
    "ran-a-list": lambda p: p.write_text(json.dumps(
        {"meta": {"vllm": "0.28.0"}, "cases": [{"name": "c", "liveness": {"patches": [
            {"patch": "a.patch", "ran": [], "added": 1}]}}]})),
    "summary-a-list": lambda p: p.write_text(json.dumps({"meta": {"vllm": "0.28.0"}, "summary": [], "cases": []})),
    "series-not-objects": lambda p: p.write_text(json.dumps({"meta": {"vllm": "0.28.0", "series": [1]},
                                                             "cases": []})),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", list(BAD_RECORDS))
def test_make_status_names_a_bad_engine_record_and_prints_the_rest(tmp_path: Path, how: str) -> None:
    """Cause 1: one bad record under ``docs/records/engine/`` stopped every ``make status``; now it is named in
    one line and the rest is printed (the good record still counted)."""
    root, records, env = _status_repo(tmp_path)
    bad = records / "bad" / "results.json"
    bad.parent.mkdir()
    BAD_RECORDS[how](bad)
    proc = subprocess.run([sys.executable, "-m", "overlay", "--patches", str(root), "status"], cwd=tmp_path,
                          capture_output=True, text=True, check=False, env=env, timeout=100)
    assert proc.returncode == 0, proc.stderr
    named = [line for line in proc.stdout.splitlines() if str(bad) in line]
    assert len(named) == 1 and named[0].startswith("record not read, counted for none: "), proc.stdout
    assert "0.28.0 (0 patches, written on this release; 1 engine-check record(s) of its build)" in proc.stdout


def test_a_case_output_beside_the_records_is_not_named(tmp_path: Path) -> None:
    """A case's output (no ``meta`` and ``cases``; a ``-Infinity`` logprob) is other JSON, not a bad record."""
    from overlay.maintain.engine_records import engine_runs, unreadable

    (tmp_path / "ref-dcp1.json").write_text('{"requests": [{"logprobs": [-Infinity]}]}')
    assert unreadable(tmp_path) == [] and engine_runs(tmp_path) == []


def test_the_repositorys_own_records_all_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard: every record the repository holds reads under the new checks."""
    monkeypatch.undo()  # the module's small LIMIT
    from overlay.maintain.engine_records import unreadable
    from overlay.maintain.rebase.stale import rebase_report

    assert unreadable(REPO / "docs" / "records" / "engine") == []
    assert all(rebase_report(p) is not None for p in (REPO / "patches").glob("*/rebase.json"))


@pytest.mark.parametrize("how", ["deep", "dev-zero", "folder", "entry-not-an-object"])
def test_a_bad_rebase_report_leaves_status_working(tmp_path: Path, how: str) -> None:
    """Cause 1, a reader the issue does not name: ``patches/<to>/rebase.json`` (``make status``'s notes and
    what is proven) raised MemoryError or IsADirectoryError for a link to ``/dev/zero`` or a folder."""
    from overlay.maintain.proven import _rebase_report
    from overlay.maintain.status import absorbed_in, off_path_notes

    report = tmp_path / "0.33.0" / "rebase.json"
    report.parent.mkdir()
    if how == "entry-not-an-object":
        report.write_text(json.dumps({"from": "0.28.0", "to": "0.33.0", "patches": [[1]]}))
    else:
        _hostile(report, how, "")
    assert absorbed_in(tmp_path, "0.28.0") == {} and off_path_notes(tmp_path, "0.33.0") == ({}, {})
    assert _rebase_report(tmp_path / "0.33.0")[1] == {}


def test_the_reader_itself() -> None:
    """The bounds, one by one, on :func:`overlay.jsonfile.loads`."""
    class E(OverlayError):
        pass

    for raw, words in [(b"[NaN]", "NaN is not a number JSON allows"), (b"[Infinity]", "Infinity is not"),
                       (b"1" * 5000, "not a"), (DEEP.encode(), "nested deeper than 64 levels"),
                       (b"\xef\xbb\xbf{}", "byte-order mark"), (b"{", "not JSON at line 1")]:
        with pytest.raises(E, match=words):
            jsonfile.loads(raw, "F", E, "a record")
    assert jsonfile.loads(b"[-Infinity]", "F", E, "x", nonfinite=True) == [float("-inf")]


def test_a_variant_name_that_leaves_the_variants_folder_is_refused(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Cause 1, a reader the issue does not name: ``variants.json`` names each variant's tarball beside it."""
    d = tmp_path / "variants"
    d.mkdir()
    (d / "variants.json").write_text(json.dumps({"variants": {"../x": {"case": "", "expect": "x", "symptom": "s"}}}))
    assert main(["engine-check", "--out", str(tmp_path / "out"), "--variants", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "variants.'../x': not a variant name (it holds a /)" in err


@pytest.mark.parametrize(("file", "words"), [
    ("../../etc/shadow", "not a file of the vllm package"),
    ("vllm/../../secret.py", "not a file of the vllm package"),
    ("/etc/shadow", "an absolute path"),
    ("vllm//a.py", "not a file of the vllm package"),
    ("other/a.py", "not a file of the vllm package"),
])
def test_a_liveness_lines_file_naming_a_file_outside_the_tree_is_refused(tmp_path: Path, file: str,
                                                                         words: str) -> None:
    """Cause 4 (security): a lines file named files outside the tree that ran, which were read and counted
    into a patch (``load_lines``, ``maintain.liveness.liveness``)."""
    from overlay.engine.inputs import EngineCheckError
    from overlay.engine.liveness_lines import load_lines
    from overlay.maintain.liveness import liveness

    path = tmp_path / "liveness.json"
    path.write_text(json.dumps({"format": 1, "vllm": "x", "series": ["a.patch"], "lines": {"a.patch": {file: [1]}}}))
    with pytest.raises(EngineCheckError) as caught:
        load_lines(path, "x")
    assert str(caught.value) == f"--liveness {path}: lines.a.patch: {file!r}: {words}" + (
        "" if words == "an absolute path" else " (vllm/..., no '.', '..' or empty parts)")
    tree = tmp_path / "tree" / "site"
    tree.mkdir(parents=True)
    with pytest.raises(ValueError, match=words):
        liveness({"a.patch": {file: [1]}}, tree, {})


def _rebase_state(path: Path) -> None:
    from overlay.maintain.rebase.state import State

    State.load(path.parent.parent)


def _cherry_pick_state(path: Path) -> None:
    from overlay.maintain.cherry_pick import _state

    _state(path)


def _verdict(path: Path) -> None:
    from overlay.regress.verdicts import judge_runs

    judge_runs(path.parent.parent, [f"{path.parent.name}=pass"])


def _engine_json(path: Path) -> None:
    from overlay.bench.engine.report import load_result

    try:
        load_result(path)
    except ValueError as exc:  # bench-engine --plot/--reanalyze makes it one line naming the file
        raise OverlayError(f"{path}: cannot read an engine.json ({exc})") from None


OTHER_READERS: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "rebase-state": (".git/overlay-rebase.json", _rebase_state, '{"from_version": "0.28.0", "index": "x"}'),
    "cherry-pick-state": (".git/overlay-cherry-pick.json", _cherry_pick_state, '{"name": 7}'),
    "verdict-json": ("run/verdict.json", _verdict, '{"verdict": "pass", "reasons": [1]}'),
    "engine-json": ("engine.json", _engine_json, '{"cells": [], "runs": {}}'),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["deep", "dev-zero", "fifo", "folder", "too-large", "wrong-shape"])
@pytest.mark.parametrize("reader", list(OTHER_READERS))
def test_the_other_records_read_the_same_way(tmp_path: Path, reader: str, how: str) -> None:
    """Cause 1, readers the issue does not name: a rebase's and a cherry-pick's state, a regress run's
    ``verdict.json``, an ``engine.json`` (``bench-engine --plot/--reanalyze``): one line naming the file."""
    where, read, wrong = OTHER_READERS[reader]
    path = tmp_path / "w" / where
    path.parent.mkdir(parents=True)
    _hostile(path, how, wrong)
    with pytest.raises(OverlayError) as caught:
        read(path)
    if reader == "rebase-state" and how in ("dev-zero", "fifo", "folder"):  # not a file: no rebase there
        assert str(caught.value).startswith(f"{path.parent.parent}: no rebase in progress there")
    else:
        _one_line(caught.value, path)


def test_a_gzipped_engine_json_is_decompressed_bounded(tmp_path: Path) -> None:
    """Cause 1: a gzipped ``engine.json`` that decompresses past the limit (a gzip bomb) is refused, not held."""
    import gzip

    from overlay.bench.engine.report import load_result

    path = tmp_path / "engine.json.gz"
    path.write_bytes(gzip.compress(b" " * (jsonfile.LIMIT * 4)))
    with pytest.raises(ValueError, match=r"decompressed, larger than an engine\.json may be"):
        load_result(path)
