"""``make bench-build``: rebuild time from the cached base wheel next to ``cp`` of that wheel.

Both are measured in the same run, alternating, so the ratio is what matters. The copy
is the floor: a build that raw-copies untouched members cannot beat it. The build also
fsyncs its output before the atomic rename, so a copy followed by fsync (a durable copy)
is timed too, to show where the rest of the time goes.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from overlay.build import build
from overlay.fetch import fetch_wheel
from overlay.pins import load_pin


def run(patches_root: Path, version: str, *, repeat: int = 5, json_out: Path | None = None) -> int:
    pin = load_pin(patches_root, version)
    wheel = fetch_wheel(pin)
    copies: list[float] = []
    durable: list[float] = []
    builds: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-build-") as tmp:
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
    if json_out:
        json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0
