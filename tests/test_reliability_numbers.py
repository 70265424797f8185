"""Issue 35 item 4, *NaN and infinity pass every number check*: one range check (:mod:`overlay.numbers`)
for the command line's number types, a regress profile's fields and ``REGRESS_ATTACH_TIMEOUT``.

Each test's docstring says what the code did before.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import yaml

from overlay import numbers
from overlay.cli import main
from overlay.commands.common import at_least, fraction, int_list, non_negative, port, positive
from overlay.regress.checks import CHECKS, HIGH, Bound
from overlay.regress.errors import ProfileError
from overlay.regress.profiles import load_profile, parse_profile

REPO = Path(__file__).resolve().parent.parent
NON_FINITE = ["nan", "NaN", "inf", "-inf", "Infinity", "1e999"]


@pytest.mark.parametrize("text", NON_FINITE)
@pytest.mark.parametrize("kind", [positive("seconds"), non_negative(), fraction()],
                         ids=["positive", "non_negative", "fraction"])
def test_number_types_refuse_nan_and_infinity(kind, text: str) -> None:
    """Before: ``float(text)`` passed every bound (``nan < 0`` is false), so ``positive`` and ``non_negative``
    took ``nan`` and ``inf``, and ``fraction`` took ``nan``."""
    with pytest.raises(argparse.ArgumentTypeError, match=rf", got {text}: not a finite number$"):
        kind(text)


@pytest.mark.parametrize("text", NON_FINITE)
@pytest.mark.parametrize("kind", [at_least(1), port(), int_list(1)], ids=["at_least", "port", "int_list"])
def test_integer_types_refuse_them_too(kind, text: str) -> None:
    """(``int('nan')`` already failed: held here so a float-accepting change cannot let them in.)"""
    with pytest.raises(argparse.ArgumentTypeError):
        kind(text)


@pytest.mark.parametrize("argv", [
    pytest.param(["regress", "--ready-timeout", "nan"], id="regress-ready-timeout-nan"),
    pytest.param(["regress", "--attach-timeout", "inf"], id="regress-attach-timeout-inf"),
    pytest.param(["engine-check", "--out", "o", "--timeout", "nan"], id="engine-timeout-nan"),
    pytest.param(["engine-check", "--out", "o", "--budget", "inf"], id="engine-budget-inf"),
    pytest.param(["bench-engine", "--gpu-memory-utilization", "nan"], id="bench-gpu-memory-nan"),
    pytest.param(["bench-engine", "--cell-seconds", "inf"], id="bench-cell-seconds-inf"),
    pytest.param(["device-stage", "--limit-mib", "nan"], id="device-limit-nan"),
])
def test_the_parser_refuses_them_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: each of these was taken and its run started (``--ready-timeout nan`` then waits for the server
    forever; ``engine-check --timeout nan`` ran every engine case). Now: usage and one line, exit 2, nothing
    started."""
    monkeypatch.chdir(tmp_path)  # relative outputs, were anything to start
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert f"error: argument {argv[-2]}: expected " in line and line.endswith(f"got {argv[-1]}: not a finite number")


PROFILE = REPO / "overlay/regress/profiles/glm5.2-nvfp4-tp8-dcp4-mtp5-a2a.yaml"


def _refused(mutate) -> str:
    data = yaml.safe_load(PROFILE.read_text())
    mutate(data)
    with pytest.raises(ProfileError) as exc:
        parse_profile(yaml.safe_dump(data), "p.yaml")
    text = str(exc.value)
    assert "\n" not in text
    return text


def _set(section: str, key: str, value):
    def mutate(data: dict) -> None:
        node = data
        for part in section.split("."):
            node = node[part]
        node[key] = value
    return mutate


@pytest.mark.parametrize(("mutate", "words"), [
    pytest.param(_set("thresholds.acceptance_cliff", "value", math.nan),
                 "thresholds.acceptance_cliff.value: must be a finite number > 0 and <= 1, got nan",
                 id="threshold-nan"),
    pytest.param(_set("thresholds.ttft_max_ratio", "value", math.inf),
                 "thresholds.ttft_max_ratio.value: must be a finite number > 0, got inf", id="threshold-inf"),
    pytest.param(_set("server", "ready_timeout_s", math.nan),
                 "server.ready_timeout_s: must be a finite number > 0, got nan", id="ready-timeout-nan"),
    pytest.param(_set("long_context", "request_timeout_s", math.inf),
                 "long_context.request_timeout_s: must be a finite number > 0, got inf", id="request-timeout-inf"),
    pytest.param(_set("baseline.latency", "mean_ttft_ms", math.inf),
                 "baseline.latency.mean_ttft_ms: must be a finite number > 0, got inf", id="baseline-ttft-inf"),
    pytest.param(_set("baseline.gsm8k", "stderr", math.nan),
                 "baseline.gsm8k.stderr: must be a finite number >= 0, got nan", id="baseline-stderr-nan"),
    pytest.param(_set("baseline.gsm8k", "strict-match", -math.inf),
                 "baseline.gsm8k.strict-match: must be a finite number >= 0 and <= 1, got -inf",
                 id="baseline-accuracy-minus-inf"),
])
def test_a_profile_refuses_non_finite_numbers(mutate, words: str) -> None:
    """Before: a threshold of ``.nan`` was taken (``nan <= 0`` is false) and could never fire; ``.inf``
    passed every ``> 0`` check; the baseline's numbers were not checked at all. Now: one line naming
    the profile file and the field."""
    assert _refused(mutate).startswith(f"p.yaml: {words}")


def _threshold(name: str, value: float):
    def mutate(data: dict) -> None:
        data["thresholds"][name] = {"value": value, "why": "the test's value"}
    return mutate


@pytest.mark.parametrize("name", [n for n, high in HIGH.items() if high is not None])
def test_a_threshold_above_its_declared_range_is_refused(name: str) -> None:
    """Before: ``acceptance_near_one: 7`` (a rate) was taken, and no position can be accepted at >= 7, so
    the collapse rules were off without a word; the same for the cliff, the drop and the repetition share.
    The rates were a list in ``profiles.py`` kept by hand beside the checks: a new rate left out of it took
    any value. Now each threshold's range is declared where its check declares it (``checks.rate``)."""
    high = HIGH[name]
    assert high is not None
    value = 7.0 * high
    assert f"p.yaml: thresholds.{name}.value: must be > 0 and <= {high}, got {value!r}" in _refused(
        _threshold(name, value))


@pytest.mark.parametrize("name", [n for n, high in HIGH.items() if high is None])
def test_a_threshold_without_an_upper_bound_takes_any_positive_value(name: str) -> None:
    data = yaml.safe_load(PROFILE.read_text())
    _threshold(name, 7.5)(data)
    assert parse_profile(yaml.safe_dump(data), "p.yaml").thresholds[name].value == 7.5


def test_every_threshold_declares_its_range() -> None:
    """A threshold is a :class:`Bound` (no default range) and belongs to one check."""
    declared = [b for c in CHECKS for b in c.thresholds]
    assert all(isinstance(b, Bound) and (b.high is None or b.high > 0) for b in declared)
    assert sorted(HIGH) == sorted(b.name for b in declared)
    with pytest.raises(TypeError):
        Bound("new_threshold")  # type: ignore[call-arg]


@pytest.mark.parametrize("value", [70000, 65536, 0, -1])
def test_a_profile_port_outside_1_to_65535_is_refused(value: int) -> None:
    """Before: ``server.port: 70000`` was taken (only ``> 0`` was checked; 0 and -1 were refused as "must be
    > 0"), where ``--port 70000`` is refused by the parser; the server was then started on a port it
    cannot bind."""
    assert _refused(_set("server", "port", value)).startswith(
        f"p.yaml: server.port: must be > 0 and <= 65535, got {value}")


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf"])
def test_regress_attach_timeout_from_the_environment_refuses_them(raw: str) -> None:
    """``REGRESS_ATTACH_TIMEOUT=nan`` (read with ``float``) reaches ``with_overrides``. Before: ``nan <= 0`` is
    false, so it was taken, and an attached run waited forever for refused connections."""
    with pytest.raises(ProfileError, match=rf"^attach timeout \(--attach-timeout, REGRESS_ATTACH_TIMEOUT\): must be "
                                           rf"a finite number > 0, got {raw}$"):
        load_profile(str(PROFILE)).with_overrides(attach_timeout_s=float(raw))


@pytest.mark.parametrize("raw", ["nan", "inf", "-5", "0"])
def test_regress_attach_timeout_names_the_variable(raw: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 42 cause 4: ``REGRESS_ATTACH_TIMEOUT=nan make regress ...``: one line naming the variable, exit 2,
    before any request. Before: ``error: attach timeout: must be a finite number > 0, got nan``, which names
    neither the variable nor where to change it."""
    monkeypatch.setenv("REGRESS_ATTACH_TIMEOUT", raw)
    out = tmp_path / "out"
    rc = main(["regress", "--profile", str(PROFILE), "--base-url", "http://127.0.0.1:9", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    finite = "" if raw in ("-5", "0") else "a finite number "
    assert err.splitlines() == [f"error: REGRESS_ATTACH_TIMEOUT: must be {finite}> 0, got {float(raw)!r}"]
    assert (out / "verdict").read_text().strip() == "harness"


@pytest.mark.parametrize(("value", "ok"), [
    (0.5, True), (1, True), (0, False), (1.5, False), (math.nan, False), (math.inf, False), (-math.inf, False),
])
def test_one_check_for_both(value: float, ok: bool) -> None:
    assert numbers.in_range(value, 0, strict=True, high=1) is ok
    assert (numbers.problem(value, 0, strict=True, high=1) is None) is ok
