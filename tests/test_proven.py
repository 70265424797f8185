"""What is proven, said once (issue 41 item 6): per release and patch, ``make status`` says whether it was
rebased, whether it is on GLM-5's path and where an engine proved it (which record, DCP size, when), from
the rebase reports and the engine-check records under ``docs/records/engine/``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from overlay.build.pins import carried_releases
from overlay.build.series import Series
from overlay.maintain.engine_records import RECORDS, engine_runs, proofs, unattributed
from overlay.maintain.proven import format_proven, proven
from tests.wheelkit import format_patch, make_release, make_wheel

REPO = Path(__file__).resolve().parent.parent
A = b"".join(f"a{i} = {i}\n".encode() for i in range(20))
PROJECT = "dcp-project-before-merge.patch"  # ACTS declares it acts at DCP > 1 on 0.28.0's build


def _patch(tmp_path: Path, line: int, last_update: str) -> bytes:
    return format_patch({"vllm/a.py": A}, {"vllm/a.py": A.replace(f"a{line} = {line}".encode(), b"x = 0")},
                        f"Fix a{line}", f"Origin: vendor\nLast-Update: {last_update}", work=tmp_path)


def _record(root: Path, where: str, meta: dict, cases: list[dict]) -> None:
    path = root / RECORDS / where / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": {"started": "2026-12-03T10:00:00", **meta}, "summary": {"verdict": "pass"},
                                "cases": cases}))


def _case(name: str, dcp: int, verdict: str = "pass", **more: object) -> dict:
    return {"name": name, "verdict": verdict, "case": {"name": name.split("--")[-1], "dcp": dcp, "tp": 2}, **more}


def _setup(tmp_path: Path) -> Path:
    wheel = make_wheel(tmp_path, {"vllm/a.py": A})
    patches = {"guard.patch": _patch(tmp_path, 3, "2026-11-30"), PROJECT: _patch(tmp_path, 9, "2026-12-02"),
               "quiet.patch": _patch(tmp_path, 15, "2026-11-30")}
    root = make_release(tmp_path, wheel, patches=patches)
    make_release(tmp_path, wheel, "0.33.0", patches={PROJECT: patches[PROJECT], "late.patch": patches["quiet.patch"]})
    (root / "0.33.0" / "rebase.json").write_text(json.dumps({"from": "0.28.0", "to": "0.33.0", "patches": [
        {"name": "guard.patch", "outcome": "upstream-by-behaviour", "carried": False},
        {"name": PROJECT, "outcome": "off-model-path", "carried": True, "evidence": "off GLM-5's path"}]}))
    sha = {p.name: p.sha256 for p in Series.load(root / "0.28.0").patches}
    # 0.28.0: a run naming its series (the guard's seed bug at DCP 2, the projection where it acts), one
    # that does not and predates the projection's last update, and one naming no build at all
    _record(tmp_path, "2xh200-2026-12-03", {"vllm": "0.28.0+ovlaaaa", "gpus": "2 x H200",
                                            "series": [{"name": n, "sha256": s} for n, s in sha.items()]},
            [_case("ref-dcp1", 1, "reference"), _case("dcp-agrs-proj1-graph", 2),
             _case("minus-guard--dcp-agrs-proj1-graph", 2, "expected-fail", variant="minus-guard")])
    _record(tmp_path, "2xh200-2026-11-30", {"vllm": "0.28.0+ovlbbbb (2 patches)", "started": "2026-11-30T09:00:00"},
            [_case("dcp-agrs-proj1-graph", 2)])
    _record(tmp_path, "1xh200-2026-11-29", {}, [_case("ref-dcp1", 1, "reference")])
    # 0.33.0: a coverage run in which the carried projection's lines ran
    _record(tmp_path, "liveness-1xh200-2026-12-04", {"vllm": "0.33.0", "started": "2026-12-04T20:00:00"},
            [_case("ref-dcp1", 1, "reference", liveness={"patches": [{"patch": PROJECT, "ran": 6, "added": 301}]})])
    return root


def test_each_release_and_patch_says_what_is_proven(tmp_path: Path) -> None:
    root = _setup(tmp_path)
    releases, unnamed = proven(root, tmp_path / RECORDS)
    assert unnamed == ["1xh200-2026-11-29"]
    old, new = releases
    assert (old.release, old.source, new.release, new.source) == ("0.28.0", "written on this release", "0.33.0",
                                                                  "rebased from 0.28.0")
    by = {p.name: p for p in old.patches}
    assert by["guard.patch"].rebased == "- (written on this release)"
    assert by["guard.patch"].engine == ("2xh200-2026-12-03 (2026-12-03, GPUs 2 x H200) DCP 2: the build without it "
                                        "failed `dcp-agrs-proj1-graph` as its seed bug does",)
    assert by["guard.patch"].on_path.startswith("yes, in GLM-5's engine: the build without it failed")
    # the record naming its series proves this version; the older one cannot say the build carried it
    assert by[PROJECT].engine == ("2xh200-2026-12-03 (2026-12-03, GPUs 2 x H200) DCP 2: `dcp-agrs-proj1-graph`, "
                                  "where it acts, passed",)
    assert by["quiet.patch"].engine == ("never: no engine-check record of this build shows it",)
    assert by["quiet.patch"].on_path.startswith("not judged")
    late = {p.name: p for p in new.patches}
    assert late[PROJECT].rebased == "off-model-path from 0.28.0"
    assert late[PROJECT].on_path.startswith("no: off-model-path in its rebase.json")
    assert late[PROJECT].engine == ("liveness-1xh200-2026-12-04 (2026-12-04) DCP 1: 6 of its 301 added statements "
                                    "ran in `ref-dcp1`, which passed",)
    assert late["late.patch"].rebased == "not in rebase.json: added after the rebase from 0.28.0"
    text = format_proven(releases, unnamed, tmp_path / RECORDS)
    assert "0.33.0 (2 patches, rebased from 0.28.0; 1 engine-check record(s) of its build)" in text
    assert text.rstrip().endswith("records that name no build (meta.vllm), counted for none: 1xh200-2026-11-29")


def test_a_record_of_another_version_of_the_patch_says_so(tmp_path: Path) -> None:
    root = _setup(tmp_path)
    doc = json.loads((tmp_path / RECORDS / "2xh200-2026-12-03" / "results.json").read_text())
    doc["meta"]["series"] = [{"name": "guard.patch", "sha256": "0" * 64}]  # the run carried another guard
    (tmp_path / RECORDS / "2xh200-2026-12-03" / "results.json").write_text(json.dumps(doc))
    by = {p.name: p for p in proven(root, tmp_path / RECORDS)[0][0].patches}
    assert by["guard.patch"].engine[0].endswith("as its seed bug does (an earlier version of it)")
    assert by[PROJECT].engine == ("never: no engine-check record of this build shows it",)  # not in that build
    # nor does a run of an earlier version put today's on GLM-5's path
    assert by["guard.patch"].on_path.startswith("not judged"), by["guard.patch"].on_path


def test_a_run_that_carried_a_patch_and_ran_none_of_it_is_said_and_proves_nothing(tmp_path: Path) -> None:
    """A coverage run of the build that carried this version of a patch, passed, and ran none of its lines
    (a DCP patch at DCP 1) is named as not proving it, rather than "never"; one of another version is not."""
    root = _setup(tmp_path)
    sha = {p.name: p.sha256 for p in Series.load(root / "0.28.0").patches}
    quiet = {"patches": [{"patch": "quiet.patch", "ran": 0, "added": 7},
                         {"patch": "guard.patch", "ran": 1, "added": 2}]}
    _record(tmp_path, "0.28.0-1xh100-2026-12-06", {"vllm": "0.28.0+ovlcccc", "gpus": "1 x NVIDIA H100",
                                                  "started": "2026-12-06T05:00:00",
                                                  "series": [{"name": n, "sha256": s} for n, s in sha.items()]},
            [_case("ref-dcp1", 1, "reference", liveness=quiet), _case("ref-dcp1-mtp", 1, "reference", liveness=quiet)])
    by = {p.name: p for p in proven(root, tmp_path / RECORDS)[0][0].patches}
    assert by["quiet.patch"].engine == ("not proven: 0.28.0-1xh100-2026-12-06 (2026-12-06, GPUs 1 x NVIDIA H100) "
                                        "DCP 1: its build served with this version and 2 case(s) passed, but none "
                                        "of its 7 added statements ran",)
    assert by["quiet.patch"].on_path.startswith("not judged")
    # a patch a run proves keeps only its proofs
    assert not any(line.startswith("not proven") for line in by["guard.patch"].engine)
    # another version of the patch in that build: nothing said of this one
    doc = json.loads((tmp_path / RECORDS / "0.28.0-1xh100-2026-12-06" / "results.json").read_text())
    doc["meta"]["series"] = [{"name": "quiet.patch", "sha256": "0" * 64}]
    (tmp_path / RECORDS / "0.28.0-1xh100-2026-12-06" / "results.json").write_text(json.dumps(doc))
    by = {p.name: p for p in proven(root, tmp_path / RECORDS)[0][0].patches}
    assert by["quiet.patch"].engine == ("never: no engine-check record of this build shows it",)


def test_on_path_by_the_glm5_path_tests_of_its_rebase(tmp_path: Path) -> None:
    """A patch carried onto GLM-5's path by a person says which of its tests showed it there."""
    root = _setup(tmp_path)
    doc = json.loads((root / "0.33.0" / "rebase.json").read_text())
    doc["patches"][1] = {"name": PROJECT, "outcome": "conflict-resolved", "carried": True,
                         "on_model_path": "81 passed with it, 43 failed by behaviour without"}
    (root / "0.33.0" / "rebase.json").write_text(json.dumps(doc))
    late = {p.name: p for p in proven(root, tmp_path / RECORDS)[0][1].patches}
    assert late[PROJECT].rebased == "conflict-resolved from 0.28.0"
    assert late[PROJECT].on_path == ("yes, by its GLM-5 path tests (rebase.json): 81 passed with it, 43 failed by "
                                     "behaviour without")


def test_the_strongest_proof_of_a_run_wins(tmp_path: Path) -> None:
    _setup(tmp_path)
    [run] = [r for r in engine_runs(tmp_path / RECORDS, "0.28.0") if r.series]
    assert {k: v.kind for k, v in proofs(run).items()} == {"guard.patch": "variant", PROJECT: "acts"}
    assert unattributed(tmp_path / RECORDS) == ["1xh200-2026-11-29"]


def test_make_status_prints_it_after_its_table(tmp_path: Path) -> None:
    root = _setup(tmp_path)
    wheel = next(tmp_path.glob("vllm-*.whl"))
    cache = tmp_path / "cache" / "wheels"
    cache.mkdir(parents=True)
    (cache / wheel.name).write_bytes(wheel.read_bytes())
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "VLLM_OVERLAY_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "overlay", "--patches", str(root), "status"], cwd=tmp_path,
                          capture_output=True, text=True, check=False, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "What is proven, per release and patch" in proc.stdout and "records in docs/records/engine/" in proc.stdout
    assert "    rebased: off-model-path from 0.28.0" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "overlay", "--patches", str(root), "status", "--json"], cwd=tmp_path,
                          capture_output=True, text=True, check=False, env=env)
    doc = json.loads(proc.stdout)
    assert [r["release"] for r in doc["proven"]] == ["0.28.0", "0.33.0"] and len(doc["patches"]) == 3


def test_the_repositorys_records_are_read() -> None:
    """Every engine record of the repository names its build or is listed as naming none, and the 0.33.0
    record kept since 2026-12-02 is among docs/records/engine/'s (the guide's folder keeps none): a retired
    release's records stay as history, and every carried release but a new one has some."""
    records = REPO / RECORDS
    runs = engine_runs(records)
    assert "0.33.0-1xh200" in {r.where for r in runs if r.release == "0.33.0"}
    assert not list((REPO / "docs" / "engine").rglob("*.json"))
    assert set(carried_releases(REPO / "patches")) <= {r.release for r in runs}
    assert set(unattributed(records)).isdisjoint(r.where for r in runs)


def test_the_readme_says_which_release_is_proven_how_far() -> None:
    """The README's "What is proven, per release" has a row per release ``patches/`` holds, with its series'
    size and the largest DCP size an engine record of its build ran (no larger one), or "never" where no
    record names its build; ``patches/DEFAULT``'s release says so; a release without a series is never proven."""
    import re

    from overlay.build.pins import default_version

    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## What is proven, per release\n", 1)[1].split("\n## ", 1)[0]
    rows = {m[1]: (m[2], m[3]) for m in re.finditer(r"^\| (\d+\.\d+\.\d+) \| (.*?) \| (.*) \|$", section, re.M)}
    runs = engine_runs(REPO / RECORDS)
    held = [p.name for p in (REPO / "patches").iterdir() if (p / "series").is_file()]
    assert set(held) <= set(rows), f"README's proven table lacks {set(held) - set(rows)}"
    for release, (series, engine) in rows.items():
        dcp = [c.dcp for r in runs if r.release == release for c in r.cases]
        if release not in held:
            assert not dcp and engine == "never", release
            continue
        assert series.startswith(f"{len(Series.load(REPO / 'patches' / release).patches)} patches"), release
        if not dcp:  # a series no engine record names (0.34.0's): never proven, whatever its rebase says
            assert engine.startswith("never"), (release, engine)
            continue
        said = [int(n) for n in re.findall(r"DCP (\d+)", engine)]
        assert dcp and max(said) == max(dcp), (release, said, sorted(set(dcp)))
    assert "`patches/DEFAULT`" in rows[default_version(REPO / "patches")][0]


def test_status_says_which_releases_are_carried_and_which_records_are_history() -> None:
    """Carried: production's (the oldest) and the default; a retired release's records are named as history,
    never as a release of the table."""
    from overlay.build.pins import default_version
    from overlay.maintain.proven import retired

    patches, records = REPO / "patches", REPO / RECORDS
    carried = carried_releases(patches)
    gone = retired(patches, engine_runs(records))
    assert "0.33.0" in gone and not set(gone) & set(carried)
    releases, unnamed = proven(patches, records)
    text = format_proven(releases, unnamed, records, default=default_version(patches), gone=gone)
    first = text.splitlines()[1]
    assert first.startswith(f"Carried releases: {carried[0]} (production's, the oldest")
    default = default_version(patches)
    assert f"{default} (the default)" in first or f"{default} (production's, the oldest, the default)" in first
    assert "records of releases no longer carried (retired, kept as history): 0.33.0 (" in text
