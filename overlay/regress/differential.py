"""Differential check: the same prompts, greedy, to a reference server and to the server under test.

Silent corruption (a wrong DCP merge, a wrong top-k, a lost prefill row) moves logprobs long
before it breaks a model's answers, and a small test checkpoint cannot answer anything. So this
check sends one batch of prompts at once (long ones past ``index_topk`` and past the DCP workspace
capacity, beside short ones) with prompt logprobs and top-k logprobs of greedy decoding, to the
reference and to the server under test, and compares them position by position with the engine
check's rule (``overlay.engine.compare``): where a logprob's context fits ``index_topk`` every
logprob is held to the dense tolerance and greedy tokens must agree (but at a near tie); beyond
it the median and 90th percentile of the deviations are held to the reference's own spread.

The reference is a running server (``REF_URL`` / ``--ref-url``: the previous image, a DCP 1
server) or recorded outputs (``--ref-file``, written by ``--record-differential FILE`` on a run
against the reference). The reference answers twice (prompts in order, then reversed: other
batches, same math); the tolerance is ``differential_safety`` x that spread, at least
``differential_floor_nats``. Prompts are seeded random token ids, sent as token lists, so no
tokenizer is involved; the server must serve vLLM's completions extensions (``prompt_logprobs``,
``return_tokens_as_token_ids``, ``return_token_ids``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from overlay import digest, textfile
from overlay.atomic import write_file
from overlay.engine.compare import compare, derive_tolerance
from overlay.regress.client import Client, describe, rate_limited
from overlay.regress.errors import RegressError
from overlay.regress.profiles import DifferentialSpec, Profile
from overlay.regress.reference import FORMAT, ShapeError, check_run, load_recording, parse_reply
from overlay.regress.results import Finding
from overlay.regress.server import Server
from overlay.regress.step import StepContext


def prompt_ids(spec: DifferentialSpec) -> list[list[int]]:
    """The prompts: seeded random token ids in ``spec.token_range``, one list per length."""
    rng = random.Random(spec.seed)
    lo, hi = spec.token_range
    return [[rng.randrange(lo, hi) for _ in range(n)] for n in spec.prompt_tokens]


def prompts_digest(ids: list[list[int]]) -> str:
    return digest.of_text(json.dumps(ids))


def collect(client: Client, ids: list[list[int]], spec: DifferentialSpec, source: str, *,
            reverse: bool = False) -> dict[str, Any]:
    """Send every prompt at once (in reverse submission order if asked); the outputs in prompt order.

    A reply of the wrong shape is a :class:`~overlay.regress.reference.ShapeError` naming ``source``.
    """
    def one(prompt: list[int]) -> dict[str, Any]:
        body = {"model": client.model, "prompt": prompt, "max_tokens": spec.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "logprobs": spec.top_logprobs, "prompt_logprobs": 1,
                "return_tokens_as_token_ids": True, "return_token_ids": True}
        r = client.http.post("/v1/completions", json=body, timeout=spec.request_timeout_s)
        r.raise_for_status()
        return parse_reply(r.json(), prompt, source)

    order = list(range(len(ids)))[::-1] if reverse else list(range(len(ids)))
    with ThreadPoolExecutor(max_workers=len(ids)) as pool:
        futures = {i: pool.submit(one, ids[i]) for i in order}
        return {"requests": [futures[i].result() for i in range(len(ids))], "model": client.model,
                "url": client.base_url}


def _served_model(url: str) -> Client:
    probe = Client(url, "")
    try:
        models = probe.models()
    except httpx.HTTPError as exc:
        probe.close()
        raise RegressError(f"differential: reference {url}: {exc}") from None
    if not models:
        probe.close()
        raise RegressError(f"differential: reference {url} serves no model")
    probe.model = models[0]
    return probe


def reference(spec: DifferentialSpec, ids: list[list[int]], ref_url: str | None, ref_file: str | None,
              say: Callable[[str], None]) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """The reference's outputs and its spread runs, from a server or a recorded file; and where from."""
    if ref_url:
        client = _served_model(ref_url)
        source = f"differential: reference {client.base_url}"
        try:
            say(f"differential: reference {client.base_url} ({client.model}): {len(ids)} prompts, twice")
            runs = [collect(client, ids, spec, source)]
            runs += [collect(client, ids, spec, source, reverse=True) for _ in range(spec.spread_runs)]
        except (httpx.HTTPError, ValueError) as exc:
            raise RegressError(f"{source}: {describe(exc) if rate_limited(exc) else exc}") from None
        finally:
            client.close()
        for k, run in enumerate(runs):
            check_run(run, ids, spec.max_tokens, f"{source}: {'reference run' if k == 0 else f'spread run {k}'}")
        return runs[0], runs[1:], client.base_url
    if not ref_file:
        raise RegressError("differential: no reference: set REF_URL (a reference server) or pass --ref-file "
                           "(outputs recorded with --record-differential)")
    path = Path(ref_file)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RegressError(f"differential: {path}: cannot read recorded outputs: {exc}") from None
    text = textfile.decode(raw, f"differential: {path}", RegressError)
    runs = load_recording(text, f"differential: {path}", ids, prompts_digest(ids), spec.max_tokens)
    return runs[0], runs[1:], str(path)


def run_differential(profile: Profile, server: Server, progress: Callable[[str], None], *,
                     ref_url: str | None = None, ref_file: str | None = None,
                     record: str | None = None) -> tuple[dict[str, Any], list[Finding]]:
    spec = profile.differential
    ids = prompt_ids(spec)
    if record:  # this server is the reference: record its outputs and spread, judge nothing
        progress(f"differential: recording {len(ids)} prompts ({', '.join(map(str, spec.prompt_tokens))} tokens), "
                 f"{1 + spec.spread_runs} times, into {record}")
        runs = [_collect(server, ids, spec)] + [_collect(server, ids, spec, reverse=True)
                                                 for _ in range(spec.spread_runs)]
        doc = {"format": FORMAT, "prompts_sha256": prompts_digest(ids), "model": server.model,
               "spec": {"prompt_tokens": list(spec.prompt_tokens), "seed": spec.seed,
                        "token_range": list(spec.token_range), "max_tokens": spec.max_tokens}, "runs": runs}
        out = Path(record)
        write_file(out, json.dumps(doc))
        return {"recorded": str(out), "requests": len(ids)}, []
    ref, spreads, source = reference(spec, ids, ref_url, ref_file, progress)
    tol, spread = derive_tolerance(ref, spreads, spec.index_topk, safety=profile.threshold("differential_safety"),
                                   floor=profile.threshold("differential_floor_nats"))
    progress(f"differential: server under test: {len(ids)} prompts at once")
    got = _collect(server, ids, spec)
    d = compare(ref, got, tol, spec.index_topk)
    data = {"reference": source, "tolerance": tol.to_dict(), "spread": spread, "diff": d.to_dict(),
            "prompt_tokens": list(spec.prompt_tokens)}
    return data, [Finding("differential", "regression", p) for p in d.problems(tol)]


def _collect(server: Server, ids: list[list[int]], spec: DifferentialSpec, *, reverse: bool = False) -> dict[str, Any]:
    try:
        return collect(server.client, ids, spec, f"server {server.base_url}", reverse=reverse)
    except (httpx.HTTPError, ValueError, ShapeError) as exc:
        cause = describe(exc)
        server.ensure_alive("differential", cause)
        raise RegressError(f"differential: {cause}") from None


def step(ctx: StepContext) -> tuple[dict[str, Any], list[Finding]]:
    return run_differential(ctx.profile, ctx.server, ctx.say, ref_url=ctx.ref_url, ref_file=ctx.ref_file,
                            record=ctx.record_differential)


def summary(data: dict[str, Any]) -> str:
    if "recorded" in data:
        return f"recorded {data['requests']} prompts into {data['recorded']}"
    d = data["diff"]
    return (f"matches {data['reference']}: dense max {d['dense_max_abs']:.3g} nats, beyond index_topk median "
            f"{d['sparse_q50']:.3g} / p90 {d['sparse_q90']:.3g}")
