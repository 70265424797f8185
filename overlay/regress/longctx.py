"""Long-context checks: prompts past ``index_topk`` and past the DCP workspace, sent together with
short decodes, then the same short question asked several times in a row.

What each check catches (the seed's symptoms): a long prefill that kills the engine (bug 4),
long-context decode degenerating into repetition (bug 2), corruption accumulating across
requests, and plain wrong answers. Every output goes through the n-gram repetition detector.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from overlay.regress.client import Client, Completion, describe, rate_limited
from overlay.regress.profiles import Profile
from overlay.regress.results import Finding
from overlay.regress.server import Server
from overlay.regress.step import StepContext
from overlay.regress.textchecks import count_run, estimate_tokens, last_int, repetition

_NOUNS = ("river", "garden", "engine", "letter", "harbor", "forest", "market", "window", "bridge", "lantern")
_ADJS = ("quiet", "golden", "narrow", "ancient", "bright", "hollow", "steady", "distant", "gentle", "busy")
_VERBS = ("watched", "followed", "crossed", "painted", "measured", "visited", "carried", "described")


def filler(tokens: int, seed: int, needle: str | None = None) -> str:
    """Deterministic prose of at least ``tokens`` estimated tokens; ``needle`` sits at 60% depth."""
    rng = random.Random(seed)
    sentences: list[str] = []
    total = 0
    day = 0
    while total < tokens:
        day += 1
        s = (f"On day {day} the {rng.choice(_ADJS)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the "
             f"{rng.choice(_ADJS)} {rng.choice(_NOUNS)} near the {rng.choice(_NOUNS)}.")
        sentences.append(s)
        total += estimate_tokens(s)
    if needle:
        sentences.insert(int(len(sentences) * 0.6), needle)
    return " ".join(sentences)


@dataclass
class Probe:
    """One request of the check and how to judge its answer."""

    name: str
    prompt: str
    min_prompt_tokens: int = 0
    expect: str = ""                       # what a right answer is, for the report
    judge: Callable[[str], str | None] = lambda text: None   # -> problem, or None when right
    result: dict[str, Any] = field(default_factory=dict)


def _expect_int(value: int) -> Callable[[str], str | None]:
    def judge(text: str) -> str | None:
        got = last_int(text)
        return None if got == value else f"expected {value}, got {got if got is not None else 'no number'}"
    return judge


def _expect_word(word: str) -> Callable[[str], str | None]:
    return lambda text: None if word in text.lower() else f"expected {word!r} in the answer"


def _expect_count(minimum: int, upto: int) -> Callable[[str], str | None]:
    def judge(text: str) -> str | None:
        run = count_run(text)
        if run.broken:
            return f"counting broke: {run.describe()}"
        if run.consecutive < min(minimum, upto):
            return f"counting stopped early: {run.describe()} (need 1..{min(minimum, upto)})"
        return None
    return judge


def probes(profile: Profile) -> tuple[list[Probe], Probe]:
    """The concurrent batch (long prompts + short decodes) and the repeated short question."""
    lc = profile.long_context
    minimum = int(profile.threshold("count_min_consecutive"))
    count = f"Count from 1 to {lc.count_to}, separated by spaces. Reply with the numbers only."
    batch: list[Probe] = []
    for i, n in enumerate(lc.prompt_tokens):
        code = 1000 + random.Random(n).randrange(9000)
        text = filler(n, seed=n, needle=f"The secret code is {code}.")
        batch.append(Probe(f"needle-{n}", f"{text}\n\nWhat is the secret code mentioned in the text above? "
                           "Reply with the number.", n, str(code), _expect_int(code)))
        text = filler(n, seed=n + 7 + i)
        batch.append(Probe(f"count-{n}", f"{text}\n\nIgnore the text above. {count}", n,
                           f"1..{lc.count_to}", _expect_count(minimum, lc.count_to)))
    batch += [
        Probe("count-short", count, 0, f"1..{lc.count_to}", _expect_count(minimum, lc.count_to)),
        Probe("add-8-2", "What is 8+2? Reply with the number.", 0, "10", _expect_int(10)),
        Probe("translate-hello", "Translate hello to French. Reply with the word only.", 0, "bonjour",
              _expect_word("bonjour")),
    ]
    repeated = Probe("add-3-4", "What is 3+4? Reply with the number.", 0, "7", _expect_int(7))
    return batch, repeated


def run_long_context(profile: Profile, server: Server, progress: Callable[[str], None]) -> tuple[
        dict[str, Any], list[Finding]]:
    lc = profile.long_context
    client = Client(server.base_url, server.model, timeout_s=lc.request_timeout_s)
    n_gram = int(profile.threshold("repetition_ngram"))
    max_ratio = profile.threshold("repetition_max_ratio")
    findings: list[Finding] = []
    batch, repeated = probes(profile)

    def send(probe: Probe) -> Completion | Exception:
        try:
            return client.chat(probe.prompt, lc.max_tokens, lc.extra_body)
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            return exc

    def judge(probe: Probe, outcome: Completion | Exception, label: str) -> None:
        if isinstance(outcome, Exception):
            cause = describe(outcome)
            server.ensure_alive("long_context", f"{label}: {cause}")
            probe.result = {"error": cause}
            # a 429 the server kept answering: it refused the load, which says nothing of the build
            findings.append(Finding("long_context", "harness" if rate_limited(outcome) else "regression",
                                    f"{label}: request failed: {cause}"))
            return
        probe.result = {"answer": outcome.text[:2000], "prompt_tokens": outcome.prompt_tokens,
                        "completion_tokens": outcome.completion_tokens}
        problem = probe.judge(outcome.text)
        rep = repetition(outcome.text, n_gram)
        probe.result["repetition"] = round(rep.duplicate_ratio, 3)
        if problem:
            findings.append(Finding("long_context", "regression", f"{label}: {problem}"))
        if rep.duplicate_ratio > max_ratio:
            findings.append(Finding("long_context", "regression",
                                    f"{label}: repetition: {rep.describe()} > {max_ratio:.0%}"))
        tokens = outcome.prompt_tokens
        if probe.min_prompt_tokens and tokens is not None and tokens < probe.min_prompt_tokens:
            findings.append(Finding("long_context", "harness", f"{label}: prompt was {tokens} tokens, "
                                    f"meant to exceed {probe.min_prompt_tokens}; raise long_context.prompt_tokens"))

    longest = max(lc.prompt_tokens)
    progress(f"long_context: {len(batch)} requests at once (prompts up to ~{longest} tokens, "
             f"index_topk {lc.index_topk}, workspace capacity {lc.workspace_capacity_tokens})")
    with ThreadPoolExecutor(max_workers=len(batch)) as pool:
        outcomes = list(pool.map(send, batch))
    for probe, outcome in zip(batch, outcomes, strict=True):
        judge(probe, outcome, probe.name)

    progress(f"long_context: asking 3+4 {lc.repeats} times in a row")
    answers: list[str] = []
    for i in range(lc.repeats):
        outcome = send(repeated)
        if isinstance(outcome, Exception):
            judge(repeated, outcome, f"{repeated.name} #{i + 1}")
            break
        answers.append(outcome.text)
    values = [last_int(a) for a in answers]
    repeated_rows = [{"answer": a[:200], "value": v} for a, v in zip(answers, values, strict=True)]
    if answers and any(v != 7 for v in values):
        shown = ", ".join("none" if v is None else str(v) for v in values)
        findings.append(Finding("long_context", "regression",
                                f"3+4 asked {lc.repeats} times in a row: got {shown} (expected 7 each time)"
                                + (": the answer drifts from request to request, corruption accumulates"
                                   if len(set(values)) > 1 else "")))
    data = {
        "index_topk": lc.index_topk,
        "workspace_capacity_tokens": lc.workspace_capacity_tokens,
        "probes": [{"name": p.name, "expect": p.expect, "min_prompt_tokens": p.min_prompt_tokens, **p.result}
                   for p in batch],
        "repeated": {"question": repeated.prompt, "answers": repeated_rows},
    }
    return data, findings


def step(ctx: StepContext) -> tuple[dict[str, Any], list[Finding]]:
    return run_long_context(ctx.profile, ctx.server, ctx.say)


def summary(data: dict[str, Any]) -> str:
    return f"{len(data['probes'])} probes and {len(data['repeated']['answers'])} repeats right"
