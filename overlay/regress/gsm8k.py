"""GSM8K through lm-eval's ``local-completions`` model, against the profile's baseline.

lm-eval runs as its own process (``python -m lm_eval run``) so that a hang can be killed at the
profile's timeout and its log kept beside the report. Requests go out as text
(``tokenized_requests=False``, no tokenizer: nothing is fetched from the hub), ``num_concurrent``
at a time. With a local dataset folder (``train.jsonl`` + ``test.jsonl``, GSM8K's fields) a task
``gsm8k_local`` is written that includes lm-eval's own ``gsm8k.yaml`` and only swaps the dataset
for JSON files, so prompts, few-shot examples and both filters are exactly lm-eval's GSM8K.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import yaml

from overlay.interrupt import bound_to_parent
from overlay.regress.errors import RegressError
from overlay.regress.profiles import GSM8K_METRICS, Profile, check_gsm8k_data
from overlay.regress.results import Finding
from overlay.regress.server import Server
from overlay.regress.step import StepContext


def lm_eval_gsm8k_yaml() -> Path:
    spec = find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RegressError("lm-eval is not installed (pip install 'vllm-overlay[regress]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "tasks" / "gsm8k" / "gsm8k.yaml"
    if not path.is_file():
        raise RegressError(f"lm-eval has no GSM8K task at {path}")
    return path


def write_local_task(data_dir: Path, task_dir: Path) -> str:
    """Write the ``gsm8k_local`` task (lm-eval's GSM8K over local JSON lines); return its name."""
    data_dir = data_dir.resolve()
    check_gsm8k_data(data_dir, "gsm8k.data")
    task_dir.mkdir(parents=True, exist_ok=True)
    task = {
        "include": str(lm_eval_gsm8k_yaml()),
        "task": "gsm8k_local",
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {"train": str(data_dir / "train.jsonl"),
                                          "test": str(data_dir / "test.jsonl")}},
    }
    (task_dir / "gsm8k_local.yaml").write_text(yaml.safe_dump(task, sort_keys=False), encoding="utf-8")
    return "gsm8k_local"


def command(profile: Profile, server: Server, out_dir: Path) -> tuple[list[str], dict[str, str], str]:
    g = profile.gsm8k
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    model_args = ",".join([
        f"model={server.model}", f"base_url={server.base_url}/v1/completions",
        f"num_concurrent={g.concurrency}", "tokenized_requests=False", "tokenizer_backend=None",
        f"max_gen_toks={g.max_gen_toks}", "max_retries=3", f"timeout={int(g.timeout_s)}",
    ])
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
           "--num_fewshot", str(g.num_fewshot), "--output_path", str(out_dir / "results"), "--log_samples"]
    if g.data:
        task = write_local_task(Path(g.data), out_dir / "tasks")
        cmd += ["--include_path", str(out_dir / "tasks")]
        # Everything is local: make sure nothing reaches for the hub (and fails slowly offline).
        env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    else:
        task = "gsm8k"
    cmd += ["--tasks", task]
    if g.limit is not None:
        cmd += ["--limit", str(g.limit)]
    return cmd, env, task


def read_results(results_dir: Path, task: str) -> dict[str, Any]:
    files = sorted(results_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise RegressError(f"lm-eval wrote no results_*.json under {results_dir}")
    data = json.loads(files[-1].read_text(encoding="utf-8"))
    row = data.get("results", {}).get(task)
    if row is None:
        raise RegressError(f"{files[-1]}: no results for task {task!r}")
    out: dict[str, Any] = {"results_file": str(files[-1]),
                           "samples": (data.get("n-samples", {}).get(task) or {}).get("effective")}
    for metric in GSM8K_METRICS:
        value = row.get(f"exact_match,{metric}")
        stderr = row.get(f"exact_match_stderr,{metric}")
        if not isinstance(value, int | float):
            raise RegressError(f"{files[-1]}: no exact_match for {metric}")
        out[metric] = {"value": float(value), "stderr": float(stderr) if isinstance(stderr, int | float) else 0.0}
    return out


def allowed_minimum(base: float, base_stderr: float, run_stderr: float, k: float) -> float:
    return base - k * math.sqrt(base_stderr ** 2 + run_stderr ** 2)


def judge(profile: Profile, results: dict[str, Any]) -> list[Finding]:
    k = profile.threshold("gsm8k_max_stderrs")
    findings = []
    for metric in GSM8K_METRICS:
        base = profile.baseline.gsm8k[metric]
        got = results[metric]
        floor = allowed_minimum(base, profile.baseline.gsm8k_stderr, got["stderr"], k)
        got["baseline"] = base
        got["allowed_min"] = round(floor, 4)
        if got["value"] < floor:
            findings.append(Finding("gsm8k", "regression", f"GSM8K {metric} {got['value']:.4f} < {floor:.4f} "
                                    f"(baseline {base:.4f} - {k:g} combined stderr)"))
    return findings


def run_gsm8k(profile: Profile, server: Server, out_dir: Path, progress: Callable[[str], None]) -> tuple[
        dict[str, Any], list[Finding]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd, env, task = command(profile, server, out_dir)
    log_path = out_dir / "lm_eval.log"
    g = profile.gsm8k
    size = f"{g.limit} questions" if g.limit else "the whole test split"
    progress(f"gsm8k: lm-eval {task}, {size}, {g.num_fewshot}-shot, {g.concurrency} concurrent "
             f"(log {log_path})")
    start = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                preexec_fn=bound_to_parent())  # never asking on after a killed run
        try:
            while True:
                try:
                    proc.wait(timeout=30.0)
                    break
                except subprocess.TimeoutExpired:
                    elapsed = time.monotonic() - start
                    if elapsed > g.timeout_s:
                        proc.kill()
                        proc.wait()
                        server.ensure_alive("gsm8k", f"lm-eval did not finish in {g.timeout_s:.0f} s")
                        raise RegressError(f"gsm8k: lm-eval did not finish in {g.timeout_s:.0f} s "
                                           f"(gsm8k.timeout_s); see {log_path}") from None
                    if not server.alive():
                        proc.kill()
                        proc.wait()
                        server.ensure_alive("gsm8k", "it stopped answering while lm-eval ran")
                    progress(f"gsm8k: lm-eval running ({int(elapsed)} s) {_last_progress(log_path)}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        server.ensure_alive("gsm8k", f"lm-eval exited with status {proc.returncode}")
        raise RegressError(f"gsm8k: lm-eval exited with status {proc.returncode}: {_failure(log_path)} "
                           f"(see {log_path})")
    results = read_results(out_dir / "results", task)
    results["task"] = task
    results["seconds"] = round(time.monotonic() - start, 1)
    results["log"] = str(log_path)
    return results, judge(profile, results)


_RATE_LIMITED = re.compile(r"Status code: 429\b")
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$")


def _failure(path: Path) -> str:
    """Why lm-eval failed, from its log: the server's 429s (lm-eval's client retries a few times and
    never reads Retry-After; its other requests then end in "Session is closed"), else the last
    exception line, else the last line."""
    text = path.read_text(encoding="utf-8", errors="replace")
    limited = len(_RATE_LIMITED.findall(text))
    if limited:
        return (f"the server answered 429 Too Many Requests {limited} time(s): it refuses the load (lm-eval "
                "retries a few times and does not wait for Retry-After); lower gsm8k.concurrency or lift the "
                "server's rate limit")
    errors = [ln.strip() for ln in text.splitlines() if _ERROR_LINE.match(ln.strip())]
    return errors[-1][:300] if errors else _last_line(path)


def _last_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else "no output"


def _last_progress(path: Path) -> str:
    text = path.read_text(encoding="utf-8", errors="replace")
    marker = text.rfind("Requesting API:")
    if marker < 0:
        return ""
    return text[marker:].split("\r")[0].split("\n")[0].strip()[:80]


def step(ctx: StepContext) -> tuple[dict[str, Any], list[Finding]]:
    return run_gsm8k(ctx.profile, ctx.server, ctx.out_dir / "gsm8k", ctx.say)


def summary(data: dict[str, Any]) -> str:
    return ", ".join(f"{m} {data[m]['value']:.4f}" for m in GSM8K_METRICS)
