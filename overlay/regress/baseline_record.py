"""``--record-baseline``: a profile whose baseline is what this run measured, instead of typed numbers.

Run against the reference server (for the tiny checkpoint: the DCP 1 server), the run's GSM8K
scores, acceptance per position and TTFT/TPOT (with the tool that measured them) replace the
``baseline`` section of a profile (the run's own, or ``--baseline-for``), and the result is
written as a new profile YAML: validated before it is written. Checks the
run did not measure keep the target profile's values, and the new ``baseline.source`` says which
were recorded, from where and when. Only checks that passed are recorded: a failed check's numbers
(a collapsed acceptance curve) are left out, and the run says so (:func:`failed_checks`).
The destinations are checked before the run starts (:func:`destinations`): writable, and no two
``--baseline-for`` profiles written to the same file.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from overlay.atomic import write_file
from overlay.outpaths import check_dir, check_file
from overlay.regress import yamltext
from overlay.regress.checks import CHECKS, RECORDED, function
from overlay.regress.errors import ProfileError
from overlay.regress.profiles import GSM8K_METRICS, load_profile, parse_profile


def destinations(record_baseline: str, baseline_for: str | list[str] | None, own: str) -> list[tuple[str, Path]]:
    """Each target profile and the file it is written to; refused before the run if one cannot be."""
    targets = ([baseline_for] if isinstance(baseline_for, str) else list(baseline_for or [])) or [own]
    for target in targets:
        load_profile(target)  # a profile that does not load fails now, not after the run
    if len(targets) == 1:
        return [(targets[0], check_file(record_baseline, "--record-baseline"))]
    folder = check_dir(record_baseline, "--record-baseline")
    out: dict[Path, str] = {}
    for target in targets:
        dest = folder / f"{Path(target).name.removesuffix('.yaml')}.yaml"
        if dest in out:
            raise ProfileError(f"--baseline-for {out[dest]} and --baseline-for {target} would both be written to "
                               f"{dest}: record them into two folders")
        out[dest] = target
    return [(target, dest) for dest, target in out.items()]


def failed_checks(steps: list[Any]) -> list[str]:
    """The recordable checks that ran and failed: their numbers are not a baseline."""
    return [s.name for s in steps if s.name in RECORDED and s.status != "pass" and s.data]


def recorded_values(steps: list[Any]) -> dict[str, Any]:
    """The baseline fields a run measured in checks that passed, each check's from its ``record``
    function (:data:`overlay.regress.checks.CHECKS`): ``gsm8k``, ``latency``, ``acceptance_per_position``."""
    by = {s.name: s for s in steps if s.status == "pass" and s.data}
    out: dict[str, Any] = {}
    for c in CHECKS:
        if c.record and c.name in by:
            out.update(function(c.record)(by[c.name].data))
    return out


def gsm8k_values(data: dict[str, Any]) -> dict[str, Any]:
    if not all(m in data for m in GSM8K_METRICS):
        return {}
    values: dict[str, Any] = {m: round(float(data[m]["value"]), 4) for m in GSM8K_METRICS}
    values["stderr"] = round(max(float(data[m]["stderr"]) for m in GSM8K_METRICS), 4)
    return {"gsm8k": values}


def latency_values(data: dict[str, Any]) -> dict[str, Any]:
    if "mean_ttft_ms" not in data:
        return {}
    return {"latency": {"mean_ttft_ms": round(float(data["mean_ttft_ms"]), 2),
                        "mean_tpot_ms": round(float(data["mean_tpot_ms"]), 3), "tool": data["tool"]}}


def acceptance_values(data: dict[str, Any]) -> dict[str, Any]:
    if not data.get("rates"):
        return {}
    return {"acceptance_per_position": [round(float(r), 4) for r in data["rates"]]}


def write_recorded_profile(target: str, values: dict[str, Any], out: Path, source: str) -> Path:
    """``target`` (a profile name or file) with ``values`` as its baseline, written to ``out``."""
    if not values:
        raise ProfileError(f"--record-baseline: the run measured nothing to record ({', '.join(RECORDED)})")
    src = Path(load_profile(target).path)
    path = src if src.is_file() else Path(__file__).resolve().parent / "profiles" / src.name
    data = yamltext.loads(yamltext.read(path), str(path))
    base = dict(data.get("baseline") or {})
    base.update(values)
    when = datetime.now(UTC).isoformat(timespec="seconds")
    base["source"] = f"recorded {when} from {source} ({', '.join(sorted(values))}; make regress --record-baseline)"
    data["baseline"] = base
    text = (f"# Written by make regress --record-baseline from {source} at {when}: the profile {path.name}\n"
            f"# with the measured baseline ({', '.join(sorted(values))}).\n") + yaml.safe_dump(data, sort_keys=False)
    parse_profile(text, str(out))  # the recorded profile must load as it is, before it is written
    write_file(out, text)
    return out
