"""Serving latency (mean TTFT and TPOT) against the baseline.

Two tools write the same ``latency.json`` keys:

- ``vllm-bench`` (the default, what the baseline was measured with): ``vllm bench serve
  --dataset-name random`` as a subprocess, its ``--save-result`` JSON read back. It needs the
  model's tokenizer to build random prompts, so it runs where the model is.
- ``builtin``: the same measurement without vLLM or a tokenizer, for a server that is not vLLM
  (the CPU stand-in) or a node without the tokenizer: ``num_prompts`` streamed completions at once
  (``--request-rate inf``) of about ``input_len`` tokens, ``ignore_eos`` with ``max_tokens =
  output_len``; TTFT is the first token's arrival, TPOT ``(latency - TTFT) / (tokens - 1)``, as
  vllm bench defines them. Its prompt length is an estimate (no tokenizer), so its numbers
  compare with a baseline measured by itself, not with vllm bench's: ``baseline.latency.tool``
  records the tool, and the profile refuses a run with the other one.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from overlay.interrupt import bound_to_parent
from overlay.regress.client import Client, StreamTiming, describe, rate_limited
from overlay.regress.errors import RegressError
from overlay.regress.profiles import Profile
from overlay.regress.results import Finding
from overlay.regress.server import Server
from overlay.regress.step import StepContext
from overlay.regress.textchecks import estimate_tokens

RESULT = "latency.json"


def bench_command(profile: Profile, server: Server, out_dir: Path) -> list[str]:
    la = profile.latency
    return [*profile.server.vllm_argv, "bench", "serve", "--backend", "openai", "--base-url", server.base_url,
            "--endpoint", "/v1/completions", "--model", server.model, "--tokenizer", profile.server.model_path,
            "--dataset-name", "random", "--random-input-len", str(la.input_len),
            "--random-output-len", str(la.output_len), "--random-range-ratio", "0",
            "--num-prompts", str(la.num_prompts), "--save-result", "--result-dir", str(out_dir),
            "--result-filename", RESULT]


def run_vllm_bench(profile: Profile, server: Server, out_dir: Path) -> dict[str, Any]:
    cmd = bench_command(profile, server, out_dir)
    log_path = out_dir / "vllm_bench.log"
    with log_path.open("wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=profile.latency.timeout_s, check=False, preexec_fn=bound_to_parent())
        except FileNotFoundError:
            raise RegressError(f"latency: {profile.server.vllm_bin!r} not found for `vllm bench serve`; "
                               "install vLLM here or use --latency-tool builtin") from None
        except subprocess.TimeoutExpired:
            server.ensure_alive("latency", "vllm bench serve timed out")
            raise RegressError(f"latency: vllm bench serve did not finish in {profile.latency.timeout_s:.0f} s "
                               f"(see {log_path})") from None
    if proc.returncode != 0:
        server.ensure_alive("latency", f"vllm bench serve exited with status {proc.returncode}")
        raise RegressError(f"latency: vllm bench serve exited with status {proc.returncode} (see {log_path})")
    path = out_dir / RESULT
    if not path.is_file():
        raise RegressError(f"latency: vllm bench serve wrote no {path}")
    data = json.loads(path.read_text(encoding="utf-8"))
    data["tool"] = "vllm-bench"
    return data


def random_prompt(tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    while estimate_tokens(" ".join(words)) < tokens:
        words.append(f"{rng.choice('bcdfghjklmnpqrstvwz')}{rng.choice('aeiou')}{rng.randrange(10, 99)}")
    return " ".join(words)


def _stats(name: str, values_ms: list[float]) -> dict[str, float]:
    ordered = sorted(values_ms)
    p99 = ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered)) - 1))] if ordered else 0.0
    return {f"mean_{name}_ms": statistics.fmean(ordered) if ordered else 0.0,
            f"median_{name}_ms": statistics.median(ordered) if ordered else 0.0,
            f"p99_{name}_ms": p99}


def run_builtin(profile: Profile, server: Server, out_dir: Path) -> dict[str, Any]:
    la = profile.latency
    client = Client(server.base_url, server.model, timeout_s=la.timeout_s)
    prompts = [random_prompt(la.input_len, seed=i) for i in range(la.num_prompts)]

    limited = 0

    def one(prompt: str) -> StreamTiming | str:
        nonlocal limited
        try:
            return client.stream_completion(prompt, la.output_len)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            limited += rate_limited(exc)
            return describe(exc)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=la.num_prompts) as pool:
        outcomes = list(pool.map(one, prompts))
    duration = time.perf_counter() - start
    client.close()
    done = [o for o in outcomes if isinstance(o, StreamTiming)]
    errors = [o for o in outcomes if isinstance(o, str)]
    if errors:
        server.ensure_alive("latency", errors[0])
    tpots = [(o.latency_s - o.ttft_s) / (o.output_tokens - 1) * 1000 for o in done if o.output_tokens > 1]
    data: dict[str, Any] = {
        "tool": "builtin", "duration": duration, "completed": len(done), "failed": len(errors),
        "errors": errors[:5], "rate_limited": limited, "total_input_tokens": sum(estimate_tokens(p) for p in prompts),
        "total_output_tokens": sum(o.output_tokens for o in done),
        **_stats("ttft", [o.ttft_s * 1000 for o in done]), **_stats("tpot", tpots),
        **_stats("itl", [x * 1000 for o in done for x in o.itls_s]),
    }
    (out_dir / RESULT).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return data


def judge(profile: Profile, data: dict[str, Any]) -> list[Finding]:
    findings: list[Finding] = []
    failed = int(data.get("failed") or 0)
    if failed or not data.get("completed"):
        # every failure a 429: the server refused the load; nothing is known of the build's latency
        kind = "harness" if failed and int(data.get("rate_limited") or 0) == failed else "regression"
        findings.append(Finding("latency", kind, f"{failed} of {failed + int(data.get('completed') or 0)} "
                                f"benchmark requests failed: {(data.get('errors') or ['?'])[0]}"))
        return findings
    for key, base, threshold in (("mean_ttft_ms", profile.baseline.mean_ttft_ms, "ttft_max_ratio"),
                                 ("mean_tpot_ms", profile.baseline.mean_tpot_ms, "tpot_max_ratio")):
        got = float(data[key])
        limit = profile.threshold(threshold)
        if got > base * limit:
            findings.append(Finding("latency", "regression", f"{key} {got:.2f} > {base * limit:.2f} "
                                    f"(baseline {base:.2f} x {limit:g})"))
    return findings


def run_latency(profile: Profile, server: Server, out_dir: Path, progress: Callable[[str], None]) -> tuple[
        dict[str, Any], list[Finding]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    la = profile.latency
    progress(f"latency: {la.tool}, random {la.input_len} in / {la.output_len} out, {la.num_prompts} prompt(s)")
    data = run_vllm_bench(profile, server, out_dir) if la.tool == "vllm-bench" else \
        run_builtin(profile, server, out_dir)
    keep = ("tool", "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
            "mean_itl_ms", "errors")
    summary = {k: data[k] for k in keep if k in data}
    summary["baseline"] = {"mean_ttft_ms": profile.baseline.mean_ttft_ms,
                           "mean_tpot_ms": profile.baseline.mean_tpot_ms, "tool": profile.baseline.latency_tool}
    summary["result_file"] = str(out_dir / RESULT)
    return summary, judge(profile, data)


def step(ctx: StepContext) -> tuple[dict[str, Any], list[Finding]]:
    return run_latency(ctx.profile, ctx.server, ctx.out_dir / "latency", ctx.say)


def summary(data: dict[str, Any]) -> str:
    return f"TTFT {data['mean_ttft_ms']:.1f} ms, TPOT {data['mean_tpot_ms']:.2f} ms ({data['tool']})"
