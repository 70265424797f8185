"""Issue 25, shared cause (c): every numeric option is range-checked by the parser (exit 2, one line).

Items 4 (``--cells ,``), 13 (``engine-check --budget -5``, ``--tp 0``) and 16 (``bench-engine
--budget -10``, cells the model cannot hold); nothing starts for any of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overlay.cli import main


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "words"), [
    pytest.param(["engine-check", "--out", "o", "--budget", "-5"], "--budget: expected seconds >= 0.0, got -5",
                 id="item13-engine-budget"),
    pytest.param(["engine-check", "--out", "o", "--tp", "0"], "--tp: expected an integer >= 1, got 0",
                 id="item13-engine-tp"),
    pytest.param(["engine-check", "--out", "o", "--parallel", "0"], "--parallel", id="engine-parallel"),
    pytest.param(["engine-check", "--out", "o", "--timeout", "0"], "--timeout", id="engine-timeout"),
    pytest.param(["bench-engine", "--budget", "-10"], "--budget: expected seconds >= 0.0, got -10",
                 id="item16-bench-budget"),
    pytest.param(["bench-engine", "--cells", ","], "--cells ',': no cell in it", id="item4-cells-comma"),
    pytest.param(["bench-engine", "--cells", "1x4096,1x4096"], "a cell is named twice", id="cells-twice"),
    pytest.param(["bench-engine", "--batches", ","], "--batches", id="batches-empty"),
    pytest.param(["bench-engine", "--contexts", "16"], "--contexts: expected an integer >= 33, got 16",
                 id="contexts-short"),
    pytest.param(["bench-engine", "--tp", "0"], "--tp", id="bench-tp"),
    pytest.param(["bench-engine", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization",
                 id="bench-gmu"),
    pytest.param(["bench-engine", "--ports", "0,70000"], "--ports", id="bench-ports"),
    pytest.param(["bench-engine", "--repeats", "0"], "--repeats", id="bench-repeats"),
    pytest.param(["regress", "--gsm8k-limit", "0"], "--gsm8k-limit", id="regress-limit"),
    pytest.param(["regress", "--port", "99999"], "--port", id="regress-port"),
    pytest.param(["regress", "--ready-timeout", "-1"], "--ready-timeout", id="regress-ready"),
    pytest.param(["device-stage", "--limit-mib", "0"], "--limit-mib", id="device-limit"),
    pytest.param(["upstream-tests", "--timeout", "0"], "--timeout", id="upstream-timeout"),
])
def test_parser_refuses_out_of_range_numbers(capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    """Issue 25 items 4, 13, 16: out-of-range numbers end at parse time with one line naming the option."""
    line = _refused(capsys, argv)
    assert line.startswith("overlay ") and "error: argument " in line and words in line, line


def test_cells_the_model_cannot_hold_are_refused_before_any_server(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 25 item 16: ``--cells 100000000x100000000`` on a 65536-token model: refused, nothing started."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "max_position_embeddings": 65536}))
    started = tmp_path / "started"
    rc = main(["bench-engine", "--out", str(tmp_path / "out"), "--model", str(model), "--cells",
               "1x4096,100000000x100000000", "--server-cmd", f"touch {started}"])
    err = capsys.readouterr().err
    assert rc == 2 and not started.exists()
    assert "holds prompts of 65536 tokens" in err and "100000000x100000000" in err and "1x4096" not in err


@pytest.mark.parametrize("verb", ["--reanalyze", "--plot"])
def test_a_cut_short_gzipped_engine_json_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      verb: str) -> None:
    """Issue 25 item 4 (first half; handled already where this branch began, kept so): ``--reanalyze
    x.json.gz`` / ``--plot`` cut short: one line naming the file, exit 2, not an EOFError."""
    import gzip

    whole = gzip.compress(json.dumps({"cells": {}, "runs": []}).encode())
    cut = tmp_path / "engine.json.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    assert main(["bench-engine", verb, str(cut), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {cut}: cannot read an engine.json (Compressed file ended before the end-of-stream "
                   "marker was reached)"]
