"""Run one engine case in this process: start ``vllm.LLM``, generate the workload, write the outputs.

``python -m overlay.engine.run_case --case CASE.json --model DIR --out OUT.json``. Started by
``engine.check`` as a child process (one engine per process: vLLM reads its environment at
start-up and spawns its workers from it), which enforces the timeout. The output JSON holds,
per request, the prompt logprobs (the logprob of every prompt token given the ones before it),
the greedy tokens with their top-5 logprobs, and the engine's start-up and generation times
and speculative-decoding counters.

The case's projection before the DCP merge (``Case.projection``) is spelled for the build this process imports
(the folder ``importlib.util.find_spec("vllm")`` finds: the installed tree, or a variant's laid first on
``PYTHONPATH``) by that build's switch, a release fact read from its files: the engine argument where it has
``ParallelConfig.dcp_v_up_proj_before_merge``, else ``VLLM_DCP_PROJECT_BEFORE_MERGE`` set before vLLM is
imported. A case asking it of a build without a switch exits 2 with one line naming the case, no engine
started. The output records what was passed (``projection``) and what the config resolved (``resolved``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from overlay.engine.workload import DECODE_STEPS, TOP_LOGPROBS, Case, prompts
from overlay.releases.derive import PROJECTION_FIELD
from overlay.releases.projection import ProjectionError, engine_settings, folder_switch
from overlay.releases.source import importable_tree


def _logprob_rows(rows: Any) -> list[list[list[float]]]:
    """vLLM's per-position logprob dicts as [[token, logprob], ...] sorted by rank (None -> [])."""
    out: list[list[list[float]]] = []
    for row in rows or []:
        if not row:
            out.append([])
            continue
        items = sorted(row.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, kv[0]))
        out.append([[int(tok), float(lp.logprob)] for tok, lp in items])
    return out


def projection_settings(case: Case, folder: Path | None) -> tuple[dict[str, str], dict[str, str]]:
    """(``EngineArgs`` keyword arguments, environment) that give ``case`` its projection before the DCP merge on
    the build whose ``vllm/`` lives in ``folder`` (the one this process imports), spelled by that build's own
    switch (:func:`overlay.releases.projection.engine_settings`: 0.34.0's series the engine argument, 0.28.0's
    the variable); nothing for a case that leaves it to the build. A case that asks ``on`` / ``off`` of a build
    that cannot take it fails here, in one line naming the case (:class:`ProjectionError`)."""
    if not case.projection:
        return {}, {}
    try:
        if folder is None:
            raise ProjectionError("no vllm importable")
        switch, build = folder_switch(folder)
        return engine_settings(switch, case.projection, build)
    except ProjectionError as exc:
        raise ProjectionError(f"case {case.name}: projection {case.projection}: {exc}") from None


def _spec_metrics(llm: Any) -> dict[str, Any]:
    wanted = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
              "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")
    out: dict[str, Any] = {}
    try:
        metrics = llm.get_metrics()
    except Exception as e:  # metrics are informative only
        return {"error": repr(e)}
    for m in metrics:
        if m.name in wanted:
            out[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    return out


def _resolved(llm: Any) -> dict[str, Any]:
    """What the engine's config resolved the options the check judges to (``Case.resolves``): the
    DCP comm backend and query replication (0.33.0 lets the model choose them), the model runner."""
    out: dict[str, Any] = {}
    try:
        config = llm.llm_engine.vllm_config
    except Exception as e:  # informative, and judged only where a case asks for it
        return {"error": repr(e)}
    parallel = config.parallel_config
    for key in ("dcp_comm_backend", "dcp_q_replicate"):
        out[key] = getattr(parallel, key, None)
    if hasattr(parallel, PROJECTION_FIELD):
        out[PROJECTION_FIELD] = getattr(parallel, PROJECTION_FIELD)
    try:
        out["use_v2_model_runner"] = bool(config.use_v2_model_runner)
    except AttributeError:
        out["use_v2_model_runner"] = None  # no choice of runner (0.34.0 removed Model Runner V1)
    except Exception as e:
        out["use_v2_model_runner"] = repr(e)
    return out


def run(case: dict[str, Any], model: str, out: Path, seed: int) -> None:
    c = Case.from_dict(case)
    # spelled before vLLM is imported (it reads its variables then, and its workers inherit them)
    kwargs, env = projection_settings(c, importable_tree())
    os.environ.update(env)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids = prompts(seed, c.prompt_lens)
    order = list(range(len(ids)))[::-1] if c.reverse else list(range(len(ids)))
    t0 = time.monotonic()
    llm = LLM(**c.engine_kwargs(model), **kwargs)
    t1 = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS, ignore_eos=True,
                            logprobs=TOP_LOGPROBS, prompt_logprobs=1)
    results = llm.generate([TokensPrompt(prompt_token_ids=ids[i]) for i in order], params, use_tqdm=False)
    t2 = time.monotonic()
    requests: list[dict[str, Any]] = [{}] * len(ids)
    for i, res in zip(order, results, strict=True):
        prompt = ids[i]
        prompt_lp: list[float | None] = [None]
        for pos, row in enumerate(res.prompt_logprobs[1:] if res.prompt_logprobs else [], start=1):
            lp = row.get(prompt[pos]) if row else None
            prompt_lp.append(float(lp.logprob) if lp is not None else None)
        comp = res.outputs[0]
        requests[i] = {
            "prompt_len": len(prompt),
            "prompt_logprobs": prompt_lp,
            "tokens": [int(t) for t in comp.token_ids],
            "top": _logprob_rows(comp.logprobs),
        }
    doc = {"case": case, "model": model, "startup_s": round(t1 - t0, 2), "generate_s": round(t2 - t1, 2),
           "requests": requests, "spec_decode": _spec_metrics(llm) if c.mtp else {}, "resolved": _resolved(llm),
           **({"projection": {"asked": c.projection, "args": kwargs, "env": env}} if c.projection else {}),
           "vllm": __import__("vllm").__version__}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m overlay.engine.run_case")
    ap.add_argument("--case", type=Path, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    try:
        run(json.loads(ns.case.read_text()), ns.model, ns.out, ns.seed)
    except ProjectionError as exc:  # before any engine started: the case's one line
        print(f"run_case: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {ns.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # vLLM spawns its workers: keep the guard
    raise SystemExit(main())
