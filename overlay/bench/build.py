"""``make bench-build``: rebuild time from the cached base wheel next to ``cp`` of that wheel,
and the time from editing one patch to having it installed.

Both are measured in the same run, alternating, so the ratio is what matters. The copy
is the floor: a build that raw-copies untouched members cannot beat it. The build also
fsyncs its output before the atomic rename, so a copy followed by fsync (a durable copy)
is timed too, to show where the rest of the time goes.

Edit -> installed: in a scratch environment holding an earlier build, one ``+`` line of one patch is
changed (a comment toggled, so the version tag changes as with a real edit), then
``overlay build --install`` runs as ``make build`` runs it (its requirements left out), against
the same edit followed by what ``make build`` did before: ``pip install --force-reinstall --no-deps``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import venv
from pathlib import Path

from overlay.atomic import child_tmpdir, scratch
from overlay.build.fetch import fetch_wheel
from overlay.build.pins import load_pin, pin_dir
from overlay.build.pipeline import build
from overlay.build.series import Series

_EDITABLE = re.compile(rb"^\+\s*(return|import|from|raise)\b.*[\w)\]]$")
_MARK = re.compile(rb"  # bench-edit \d+$")


def run(patches_root: Path, version: str, *, repeat: int = 5, json_out: Path | None = None) -> int:
    pin = load_pin(patches_root, version)
    wheel = fetch_wheel(pin)
    copies: list[float] = []
    durable: list[float] = []
    builds: list[float] = []
    with scratch("bench-build-") as tmp:
        out = Path(tmp)
        build(patches_root, version, out / "warm", base_wheel=wheel)  # warm the page cache
        for i in range(repeat):
            t0 = time.perf_counter()
            shutil.copyfile(wheel, out / f"copy-{i}.whl")
            copies.append(time.perf_counter() - t0)
            (out / f"copy-{i}.whl").unlink()
            t0 = time.perf_counter()
            shutil.copyfile(wheel, out / f"dcopy-{i}.whl")
            with (out / f"dcopy-{i}.whl").open("rb+") as fh:
                os.fsync(fh.fileno())
            durable.append(time.perf_counter() - t0)
            (out / f"dcopy-{i}.whl").unlink()
            t0 = time.perf_counter()
            res = build(patches_root, version, out / f"b{i}", base_wheel=wheel)
            builds.append(time.perf_counter() - t0)
            res.wheel.unlink()
    copy_s, build_s = statistics.median(copies), statistics.median(builds)
    durable_s = statistics.median(durable)
    result = {
        "wheel": pin.wheel,
        "wheel_mb": round(wheel.stat().st_size / 1e6, 1),
        "repeat": repeat,
        "copy_s_median": round(copy_s, 4),
        "durable_copy_s_median": round(durable_s, 4),
        "build_s_median": round(build_s, 4),
        "ratio": round(build_s / copy_s, 2),
        "targets": {"ratio_max": 4.0, "build_s_max": 20.0},
    }
    print(f"base wheel      {pin.wheel} ({result['wheel_mb']} MB)")
    print(f"cp (floor)      {copy_s:.3f} s  (median of {repeat})")
    print(f"cp + fsync      {durable_s:.3f} s  (median of {repeat})")
    print(f"overlay build   {build_s:.3f} s  (median of {repeat}; output fsynced before its rename)")
    print(f"ratio           {build_s / copy_s:.2f}x the copy, {build_s / durable_s:.2f}x the durable copy"
          "  (target <= 4x the copy and <= 20 s)")
    result["edit_to_installed"] = edit_to_installed(patches_root, version, wheel, repeat=repeat)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _edit(patches_root: Path, version: str, i: int) -> str:
    """Change one added line of the last patch that has a simple one (a trailing comment); its name.

    The last such patch: a later patch's context may hold the line.
    """
    for patch in reversed(Series.load(pin_dir(patches_root, version)).patches):
        path = pin_dir(patches_root, version) / patch.name
        lines = path.read_bytes().split(b"\n")
        for k, line in enumerate(lines):
            plain = _MARK.sub(b"", line)
            if _EDITABLE.match(plain):
                lines[k] = plain + b"  # bench-edit %d" % i
                path.write_bytes(b"\n".join(lines))
                return patch.name
    raise RuntimeError(f"no patch of {version} has a line to edit")


def _overlay(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "overlay", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"overlay {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stderr


def _seconds(stderr: str, word: str) -> float:
    m = re.search(rf"^{word} .*?([\d.]+) s\)$", stderr, re.M)
    return float(m.group(1)) if m else float("nan")


def edit_to_installed(patches_root: Path, version: str, wheel: Path, *, repeat: int) -> dict[str, object]:
    """Seconds from a one-patch edit to installed: now (incremental) and before (pip --force-reinstall)."""
    with scratch("bench-install-") as tmp:
        root, env, dist = Path(tmp) / "patches", Path(tmp) / "env", Path(tmp) / "dist"
        shutil.copytree(pin_dir(patches_root, version), root / version)
        venv.EnvBuilder(with_pip=True).create(env)
        common = ["--patches", str(root), "build", "--vllm", version, "--dist", str(dist),
                  "--base-wheel", str(wheel)]
        _overlay([*common, "--install", str(env), "--no-deps"])  # the earlier build (pip: first install)
        name = _edit(root, version, 0)
        t0 = time.perf_counter()
        built = _overlay(common).strip().splitlines()
        new_wheel = next(line.split()[1] for line in built if line.startswith("built "))
        with child_tmpdir() as pip_env:
            subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            "--no-deps", "--force-reinstall", new_wheel], check=True, env=pip_env)
        before = time.perf_counter() - t0
        totals, builds, installs = [], [], []
        for i in range(1, repeat + 1):
            _edit(root, version, i)
            t0 = time.perf_counter()
            err = _overlay([*common, "--install", str(env), "--no-deps"])
            totals.append(time.perf_counter() - t0)
            builds.append(_seconds(err, "built"))
            installs.append(_seconds(err, "installed"))
    now = statistics.median(totals)
    out = {"patch": name, "repeat": repeat, "before_pip_s": round(before, 3), "now_s_median": round(now, 3),
           "now_build_s_median": round(statistics.median(builds), 3),
           "now_install_s_median": round(statistics.median(installs), 3), "ratio": round(before / now, 1),
           "target_s_max": 5.0}
    print(f"edit -> installed, one-patch edit of {name} (overlay build --install, process start to end):")
    print(f"  before        {before:.3f} s  (build, then pip install --force-reinstall --no-deps; once)")
    print(f"  now           {now:.3f} s  (median of {repeat}: build {out['now_build_s_median']:.3f} s + "
          f"install {out['now_install_s_median']:.3f} s, the rest is start-up)")
    print(f"  ratio         {before / now:.1f}x faster  (target <= 5 s)")
    return out
