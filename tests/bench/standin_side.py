"""The A/B stand-in for ``make bench-engine``'s tests: ``tests/regress/standin.py`` with per-side arguments.

``python tests/bench/standin_side.py --port P --model-name N --side S -- VLLM ARGS`` (the benchmark's
``--server-cmd`` with ``{side}`` and ``{args}``) becomes the stand-in with the extra arguments of
``BENCH_STANDIN_A`` when the server was told the projection before the DCP merge is on (server A), else of
``BENCH_STANDIN_B``: the test can make one side slower, or make one die, through the very setting the benchmark
gives. With ``--side C`` and ``BENCH_STANDIN_C`` set, the twin takes that variable's arguments instead: a twin
that is not identical to A.

It stands for a build that reads the projection one way, ``BENCH_STANDIN_SWITCH`` (``argument``, the default:
the build the tests import, 0.34.0's series; ``env``: 0.28.0's): ``--dcp-v-up-proj-before-merge on|off`` among
the vLLM arguments, or ``VLLM_DCP_PROJECT_BEFORE_MERGE`` 1 / 0 in the environment. A server told the other way,
told both ways, or not told exits 3 with a message, so a benchmark that spells it wrong for its build cannot
pass (as vLLM would refuse an argument it lacks, or run its default ignoring a variable it does not read). What
it was told goes first into the server's log (``standin_side: projection on by argument``).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

STANDIN = Path(__file__).resolve().parent.parent / "regress" / "standin.py"
ARGUMENT = "--dcp-v-up-proj-before-merge"
VARIABLE = "VLLM_DCP_PROJECT_BEFORE_MERGE"


def told(vllm_args: list[str], environ: dict[str, str], switch: str) -> str:
    """``on`` / ``off``, as a build of ``switch`` reads it from the server's arguments and environment; a
    ``SystemExit(3)`` with a message for a server told another way."""
    argument = vllm_args[vllm_args.index(ARGUMENT) + 1] if ARGUMENT in vllm_args else None
    variable = environ.get(VARIABLE)
    if switch == "argument" and variable is None and argument in ("on", "off"):
        return argument
    if switch == "env" and argument is None and variable in ("0", "1"):
        return "on" if variable == "1" else "off"
    sys.stderr.write(f"standin_side: a build switched by {switch} was given {ARGUMENT} {argument!r} and "
                     f"{VARIABLE}={variable!r}\n")
    raise SystemExit(3)


if __name__ == "__main__":
    args = sys.argv[1:]
    vllm_args: list[str] = []
    if "--" in args:  # the benchmark's {args}: the vLLM arguments, read for the projection only
        i = args.index("--")
        args, vllm_args = args[:i], args[i + 1:]
    side = None
    if "--side" in args:  # the benchmark's {side}: only the twin C may have arguments of its own
        i = args.index("--side")
        side, args = args[i + 1], args[:i] + args[i + 2:]
    switch = os.environ.get("BENCH_STANDIN_SWITCH", "argument")
    projection = told(vllm_args, dict(os.environ), switch)
    sys.stderr.write(f"standin_side: projection {projection} by {switch}\n")  # the server's log says what it got
    sys.stderr.flush()
    name = "BENCH_STANDIN_C" if side == "C" and "BENCH_STANDIN_C" in os.environ else (
        "BENCH_STANDIN_A" if projection == "on" else "BENCH_STANDIN_B")
    extra = shlex.split(os.environ.get(name, ""))
    os.execv(sys.executable, [sys.executable, str(STANDIN), *args, *extra])
