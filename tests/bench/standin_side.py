"""The A/B stand-in for ``make bench-engine``'s tests: ``tests/regress/standin.py`` with per-side arguments.

``python tests/bench/standin_side.py --port P --model-name N`` becomes the stand-in with the extra
arguments of ``BENCH_STANDIN_A`` when ``VLLM_DCP_PROJECT_BEFORE_MERGE=1`` (server A), else of
``BENCH_STANDIN_B``: the test can make one side slower, or make one die, through the very variable
the benchmark sets. With ``--side C`` (the benchmark's ``{side}``) and ``BENCH_STANDIN_C`` set, the
twin takes that variable's arguments instead: a twin that is not identical to A. Anything else in
the environment (``VLLM_DCP_PROJECT_BEFORE_MERGE`` missing) exits 3 with a message, so a benchmark
that forgot to set it cannot pass.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

STANDIN = Path(__file__).resolve().parent.parent / "regress" / "standin.py"

if __name__ == "__main__":
    flag = os.environ.get("VLLM_DCP_PROJECT_BEFORE_MERGE")
    if flag not in ("0", "1"):
        sys.stderr.write(f"standin_side: VLLM_DCP_PROJECT_BEFORE_MERGE is {flag!r}, not 0 or 1\n")
        raise SystemExit(3)
    args = sys.argv[1:]
    side = None
    if "--side" in args:  # the benchmark's {side}: only the twin C may have arguments of its own
        i = args.index("--side")
        side, args = args[i + 1], args[:i] + args[i + 2:]
    name = "BENCH_STANDIN_C" if side == "C" and "BENCH_STANDIN_C" in os.environ else (
        "BENCH_STANDIN_A" if flag == "1" else "BENCH_STANDIN_B")
    extra = shlex.split(os.environ.get(name, ""))
    os.execv(sys.executable, [sys.executable, str(STANDIN), *args, *extra])
