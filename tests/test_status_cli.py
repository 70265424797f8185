"""``status`` rows and the CLI's one-line errors and exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from overlay.maintain.status import format_table, series_status
from tests.wheelkit import format_patch, make_release, make_wheel

REPO = Path(__file__).resolve().parent.parent
A = b"".join(f"a{i} = {i}\n".encode() for i in range(20))


def _release(tmp_path: Path) -> tuple[Path, Path]:
    d = tmp_path / "base"
    d.mkdir()
    wheel = make_wheel(d, {"vllm/a.py": A})
    good = format_patch({"vllm/a.py": A}, {"vllm/a.py": A.replace(b"a3 = 3", b"a3 = 33")}, "Fix a3",
                        "Origin: vendor\nApplied-Upstream: 0.29.0\nLast-Update: 2026-11-30", work=tmp_path)
    stale = format_patch({"vllm/a.py": A.replace(b"a9 = 9", b"a9 = 7")},
                         {"vllm/a.py": A.replace(b"a9 = 9", b"a9 = 99")}, "Fix a9", work=tmp_path)
    kern = format_patch({"csrc/k.cu": b"a\n"}, {"csrc/k.cu": b"b\n"}, "Fix kernel", work=tmp_path)
    return make_release(tmp_path, wheel, patches={"good.patch": good, "stale.patch": stale, "kern.patch": kern}), wheel


def test_status_rows(tmp_path: Path) -> None:
    root, wheel = _release(tmp_path)
    rows = series_status(root, "0.28.0", base_wheel=wheel)
    assert [(r.name, r.kind, r.applies, r.applied_upstream) for r in rows] == [
        ("good.patch", "python", True, "0.29.0"),
        ("stale.patch", "python", False, ""),
        ("kern.patch", "kernel", True, ""),
    ]
    assert rows[1].detail.startswith("patch stale.patch: vllm/a.py: hunk #1")
    table = format_table(rows, "0.28.0")
    assert "good.patch   python  yes      0.29.0    vendor  Fix a3" in table
    assert "stale.patch  python  NO" in table


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "overlay", *args], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, check=False)


def test_cli_reports_one_line_and_exit_code(tmp_path: Path) -> None:
    root, wheel = _release(tmp_path)
    (root / "0.28.0" / "series").write_text("good.patch\nstale.patch\n")
    proc = _cli("--patches", str(root), "build", "--base-wheel", str(wheel), "--dist", str(tmp_path / "d"),
                cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: patch stale.patch: vllm/a.py: hunk #1")
    assert not (tmp_path / "d").exists()


def test_cli_status_exit_code(tmp_path: Path) -> None:
    root, wheel = _release(tmp_path)
    (root / "0.28.0" / "series").write_text("good.patch\n")
    cache = tmp_path / "cache" / "wheels"
    cache.mkdir(parents=True)
    (cache / wheel.name).write_bytes(wheel.read_bytes())
    proc = subprocess.run([sys.executable, "-m", "overlay", "--patches", str(root), "status"], cwd=tmp_path,
                          capture_output=True, text=True, check=False,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                               "VLLM_OVERLAY_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    assert "good.patch" in proc.stdout


def test_absorbed_in_reads_later_rebase_reports(tmp_path: Path) -> None:
    import json

    from overlay.maintain.status import absorbed_in

    def report(to: str, entries: list[dict[str, object]]) -> None:
        (tmp_path / to).mkdir()
        (tmp_path / to / "rebase.json").write_text(json.dumps({"from": "0.28.0", "to": to, "patches": entries}))

    report("0.33.0", [{"name": "a.patch", "outcome": "upstream-by-behaviour", "carried": False},
                      {"name": "b.patch", "outcome": "conflict-resolved", "carried": False},
                      {"name": "c.patch", "outcome": "conflict-resolved", "carried": True}])
    report("0.29.0", [{"name": "a.patch", "outcome": "upstream", "carried": False},
                      {"name": "b.patch", "outcome": "conflict-resolved", "carried": True,
                       "evidence": "partly upstream: the a2a half is still ours"},
                      {"name": "c.patch", "outcome": "applied", "carried": True}])
    assert absorbed_in(tmp_path, "0.28.0") == {"a.patch": "0.29.0", "b.patch": "0.33.0"}
    (tmp_path / "0.33.0" / "rebase.json").unlink()
    assert absorbed_in(tmp_path, "0.28.0") == {"a.patch": "0.29.0", "b.patch": "partly 0.29.0"}


def test_off_model_path_shown_for_the_pin_and_its_base(tmp_path: Path) -> None:
    """A rebase.json entry's ``off_model_path`` shows in ``make status``: as a later pin's note on the
    pin it was rebased from, and as a note of the pin's own row; entries without it, or with a
    non-string one, show nothing."""
    import json

    root, wheel = _release(tmp_path)
    why = "the model runs Other.forward, which merges itself; confined to Base.forward_impl"
    later = root / "0.33.0"
    later.mkdir()
    (later / "rebase.json").write_text(json.dumps({"from": "0.28.0", "to": "0.33.0", "patches": [
        {"name": "good.patch", "outcome": "applied", "carried": True, "off_model_path": why},
        {"name": "stale.patch", "outcome": "applied", "carried": True, "off_model_path": ["not text"]},
        {"name": "kern.patch", "outcome": "applied", "carried": True}]}))
    (root / "0.28.0" / "rebase.json").write_text(json.dumps({"from": "0.27.0", "to": "0.28.0", "patches": [
        {"name": "kern.patch", "outcome": "applied", "carried": True, "off_model_path": "kernels only"}]}))
    rows = {r.name: r for r in series_status(root, "0.28.0", base_wheel=wheel)}
    assert rows["good.patch"].later == (f"0.33.0: off the model's path: {why}",)
    assert rows["good.patch"].notes == ()
    assert rows["stale.patch"].later == () and rows["stale.patch"].notes == ()
    assert rows["kern.patch"].later == () and rows["kern.patch"].notes == ("off the model's path: kernels only",)
    assert rows["good.patch"].to_dict()["later"] == [f"0.33.0: off the model's path: {why}"]
    table = format_table(list(rows.values()), "0.28.0")
    assert f"    later pin 0.33.0: off the model's path: {why}\n" in table
    assert "  kern.patch: csrc/k.cu\n    off the model's path: kernels only\n" in table


def test_committed_0_34_0_projection_is_carried_in_pieces() -> None:
    """patches/0.34.0/rebase.json keeps what the rebase did with the 0.28.0 projection (carried onto GLM-5's
    path); the series carries it since in pieces written after the rebase, which ``make status`` says, the
    first of them on GLM-5's DeepseekV32Attention and none reading an environment variable."""
    import json

    from overlay.build.series import Series
    from overlay.maintain.proven import proven

    doc = json.loads((REPO / "patches" / "0.34.0" / "rebase.json").read_text())
    entry = next(e for e in doc["patches"] if e["name"] == "dcp-project-before-merge.patch")
    assert "off_model_path" not in entry and entry["outcome"] == "conflict-resolved" and entry["carried"]
    series = Series.load(REPO / "patches" / "0.34.0")
    pieces = [p for p in series.patches if "v-up-proj" in p.name]
    assert len(pieces) >= 3 and "dcp-project-before-merge.patch" not in [p.name for p in series.patches]
    releases, _ = proven(REPO / "patches", REPO / "docs" / "records" / "engine")
    late = {p.name: p for r in releases if r.release == "0.34.0" for p in r.patches}
    assert all(late[p.name].rebased == "not in rebase.json: added after the rebase from 0.28.0" for p in pieces)
    first = (REPO / "patches" / "0.34.0" / pieces[0].name).read_text()
    assert "+++ b/vllm/models/deepseek_v32/attention.py" in first
    assert "+                self.dcp_manager.v_up_proj_combine(" in first
    assert not any("VLLM_DCP_PROJECT_BEFORE_MERGE" in (REPO / "patches" / "0.34.0" / p.name).read_text()
                   for p in series.patches)
