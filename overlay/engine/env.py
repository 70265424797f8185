"""What the engine check and bench-engine share about the machine they run engines on.

The repository's root and the test-only ``deep_gemm`` stand-in put first on the engines'
``PYTHONPATH``, the environment that keeps NVLink multicast off, the port ranges of engines side by
side, and how a failed engine's log is told in one line. No command line here: ``engine.check`` and
``bench.engine`` import it.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "tests" / "engine" / "standin"
TRANSPORTS = ("direct", "a2a", "ag_rs")  # bench-engine --transport: DCP's combine paths
DEFAULT_VLLM = "python3 -m vllm.entrypoints.cli.main"  # the vLLM command line bench-engine starts
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_ACCESS_LINE = re.compile(r'"(GET|POST|PUT|DELETE|HEAD) \S+ HTTP/[\d.]+"')  # uvicorn's / http.server's access log
_ERROR_LINE = re.compile(r"(\b\w*(Error|Exception)\b[:(]|token count exceeds|Traceback)")


def error_cause(log: str) -> str | None:
    """The last exception line of a failed run's log (a worker's first), or None if it has none."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    hits = [ln for ln in lines if _ERROR_LINE.search(ln) and not ln.startswith("Traceback")
            and not re.search(r"\braise \w+\($", ln)]  # the source line of a multi-line raise
    if not hits:
        return None
    # vLLM re-raises a worker's error in the engine core and the driver: the worker's line names
    # the cause; else the last line that is not one of the generic wrappers.
    worker = [h for h in hits if h.startswith("(Worker")]
    generic = ("Engine core initialization failed", "EngineDeadError", "WorkerProc initialization failed",
               "Worker failed with error")
    specific = [h for h in hits if not any(g in h for g in generic)]
    return strip_log_prefix((worker or specific or hits)[-1])[:400]


def error_line(log: str) -> str:
    """The most telling line of a failed run's log: the last exception line, else the last line that
    is not a served request (an access-log line is no cause)."""
    if (cause := error_cause(log)) is not None:
        return cause
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    own = [ln for ln in lines if not _ACCESS_LINE.search(ln)]
    return own[-1][:400] if own else "(no error in its output)" if lines else "(no output)"


def strip_log_prefix(line: str) -> str:
    """``(Worker_TP0 pid=1) ERROR 11-30 13:03:01 [file.py:1] RuntimeError: x`` -> ``RuntimeError: x``."""
    m = re.search(r"\b\w*(Error|Exception)\b[:(].*", line)
    return m.group(0) if m else line


PORT_BASE = 21000  # slot k's engines take ports from PORT_BASE + k * PORT_STRIDE upward (VLLM_PORT)
PORT_STRIDE = 400
