"""A stand-in for ``overlay.engine.run_case`` in the scheduler's CPU tests: no engine, just the protocol.

Same arguments; writes ``<out>.env.json`` (the environment it ran with: port, cache folder,
PYTHONPATH), then behaves as the case's env asks: ``FAKE_WAIT_FOR=NAME`` waits (up to ``FAKE_WAIT_S``, 20 s)
until job NAME has started (proves two jobs ran at once), ``FAKE_HANG=1`` never ends,
``FAKE_CRASH_HANG=MSG`` logs a fatal worker error and never ends,
``FAKE_CRASH=MSG`` prints MSG and exits 1; otherwise writes a minimal run output, after calling
``run(case)`` of the module ``FAKE_VLLM_RUN`` names (a fake ``vllm`` engine under ``--coverage``). Like the engine it
stands for, it logs the capture of FULL decode graphs for a case that asks for them, and records the
settings it ``resolved``: what the release facts in ``FAKE_FACTS`` (``ReleaseFacts.to_dict()`` as JSON; none:
a release with fixed DCP defaults on the V1 runner) make of the options the case leaves unset, and the
model runner (V2 where the facts default to it, unless ``VLLM_USE_V2_MODEL_RUNNER=0`` selects V1)
(``FAKE_RESOLVED``, a JSON object, overrides them: an engine resolving otherwise). Where the facts' release
has the direct DCP top-k exchange, a DCP > 1 a2a case logs building it as vLLM 0.34.0 does, unless
``VLLM_USE_DIRECT_DCP_A2A=0`` or ``FAKE_NO_DIRECT_TOPK=1`` (a build that does not).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _resolved(case: dict) -> dict:
    facts = json.loads(os.environ.get("FAKE_FACTS") or "{}")
    v1 = facts.get("v1_runner", True) and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0"
    resolved = {"dcp_comm_backend": case.get("backend") or facts.get("dcp_comm_backend", "ag_rs"),
                "dcp_q_replicate": facts.get("dcp_q_replicate") if case.get("q_replicate") is None
                else case["q_replicate"],
                "use_v2_model_runner": facts.get("runner", "v1") == "v2" and not v1}
    return resolved | json.loads(os.environ.get("FAKE_RESOLVED") or "{}")


def _direct_topk(case: dict) -> bool:
    """The release has the direct top-k exchange, the case runs DCP > 1 over a2a and leaves it on."""
    facts = json.loads(os.environ.get("FAKE_FACTS") or "{}")
    has = any(m.endswith(".dcp_topk_direct") for m in facts.get("direct_a2a_switches", []))
    return (has and case.get("dcp", 1) > 1 and _resolved(case)["dcp_comm_backend"] == "a2a"
            and os.environ.get("VLLM_USE_DIRECT_DCP_A2A") != "0")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", type=Path, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ns = ap.parse_args()
    keys = ("VLLM_PORT", "VLLM_CACHE_ROOT", "PYTHONPATH", "VLLM_DISABLE_COMPILE_CACHE", "NCCL_NVLS_ENABLE")
    ns.out.with_suffix(".env.json").write_text(json.dumps({k: os.environ.get(k) for k in keys}))
    if wait := os.environ.get("FAKE_WAIT_FOR"):
        other = ns.out.parent / f"{wait}.json"
        deadline = time.monotonic() + float(os.environ.get("FAKE_WAIT_S", "20"))
        while not other.with_suffix(".env.json").exists():
            if time.monotonic() > deadline:
                print(f"RuntimeError: {wait} never started beside me", flush=True)
                return 1
            time.sleep(0.05)
    if os.environ.get("FAKE_HANG"):
        time.sleep(3600)
    if msg := os.environ.get("FAKE_CRASH_HANG"):  # a dead engine that does not exit
        print(f"(Worker pid=1) ERROR WorkerProc hit an exception.\n(Worker pid=1) ERROR {msg}", flush=True)
        time.sleep(3600)
    if msg := os.environ.get("FAKE_CRASH"):
        print(msg, flush=True)
        return 1
    case = json.loads(ns.case.read_text())
    if module := os.environ.get("FAKE_VLLM_RUN"):
        __import__("importlib").import_module(module).run(case)
    if case.get("graphs") == "FULL":
        print("Capturing CUDA graphs (decode, FULL): 100%|##| 20/20 [00:02<00:00]", flush=True)
    if _direct_topk(case) and not os.environ.get("FAKE_NO_DIRECT_TOPK"):
        print("INFO [dcp_topk_direct.py:214] Using symmetric-memory direct DCP top-k candidate exchange "
              "(max_rows=1024, candidates_per_rank=2048).", flush=True)
    doc = {"requests": [{"prompt_len": 2, "prompt_logprobs": [None, -1.0], "tokens": [5], "top": [[[5, -0.1]]]}],
           "startup_s": 0.1, "generate_s": 0.1, "resolved": _resolved(case)}
    ns.out.write_text(json.dumps(doc))
    print(f"wrote {ns.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
