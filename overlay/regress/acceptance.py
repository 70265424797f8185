"""Speculative-decoding acceptance per draft position, from the server's Prometheus ``/metrics``.

Rate at position p = delta ``vllm:spec_decode_num_accepted_tokens_per_pos{position=p}`` over
delta ``vllm:spec_decode_num_drafts``, across the run (snapshots before and after, summed over
engines). The collapse signature from the seed: the first positions accepted at ~1.0 (the
draft is never rejected because the corrupted target agrees with it) and then a cliff.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from overlay.regress.errors import RegressError
from overlay.regress.profiles import Profile
from overlay.regress.results import Finding
from overlay.regress.step import StepContext

DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecCounters:
    drafts: float
    accepted: dict[int, float]


def parse_counters(text: str) -> SpecCounters | None:
    """The spec-decode counters in an exposition, or None when the server exposes none."""
    drafts: float | None = None
    accepted: dict[int, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise RegressError(f"/metrics is not Prometheus text format: {exc}") from None
    for family in families:
        for sample in family.samples:
            # Match on sample names: counters are exposed as name_total (prometheus_client writes
            # "# TYPE name_total counter"); untyped expositions may use the bare name.
            base = sample.name.removesuffix("_total")
            if base == DRAFTS:
                drafts = (drafts or 0.0) + sample.value
            elif base == ACCEPTED_PER_POS and "position" in sample.labels:
                pos = int(sample.labels["position"])
                accepted[pos] = accepted.get(pos, 0.0) + sample.value
    if drafts is None:
        return None
    return SpecCounters(drafts, accepted)


def rates_between(before: SpecCounters, after: SpecCounters) -> tuple[float, list[float]]:
    drafts = after.drafts - before.drafts
    positions = sorted(after.accepted)
    if drafts <= 0:
        return drafts, []
    return drafts, [(after.accepted[p] - before.accepted.get(p, 0.0)) / drafts for p in positions]


def collapse_signature(rates: list[float], near_one: float, cliff: float) -> str | None:
    """Describe the collapse signature if ``rates`` show it, else None."""
    lead = 0
    while lead < len(rates) and rates[lead] >= near_one:
        lead += 1
    if lead == 0 or len(rates) < 2:
        return None
    shown = ", ".join(f"{r:.3f}" for r in rates)
    if lead == len(rates):
        return f"every position accepted at >= {near_one}: {shown} (the draft is never rejected)"
    drop = rates[lead - 1] - rates[lead]
    if drop >= cliff:
        return (f"positions 0..{lead - 1} near 1.0 then a cliff of {drop:.2f} at position {lead}: {shown} "
                "(target output corrupted, the rejection sampler lost its signal)")
    return None


def judge(profile: Profile, before: SpecCounters | None, after: SpecCounters | None) -> tuple[
        dict[str, object], list[Finding]]:
    baseline = list(profile.baseline.acceptance_per_position or [])
    if before is None or after is None:
        return {"baseline": baseline}, [Finding("acceptance", "harness",
                "/metrics has no vllm:spec_decode_* counters; is speculative decoding on "
                "(--speculative-config)?")]
    drafts, rates = rates_between(before, after)
    data: dict[str, object] = {"drafts": drafts, "rates": [round(r, 4) for r in rates], "baseline": baseline}
    if not rates:
        return data, [Finding("acceptance", "harness", f"no drafts during the run (delta {drafts:g}); "
                              "the acceptance rates cannot be computed")]
    findings: list[Finding] = []
    signature = collapse_signature(rates, profile.threshold("acceptance_near_one"),
                                   profile.threshold("acceptance_cliff"))
    if signature:
        findings.append(Finding("acceptance", "regression", f"acceptance collapse: {signature}"))
    max_drop = profile.threshold("acceptance_max_drop")
    for pos, (rate, base) in enumerate(zip(rates, baseline, strict=False)):
        if base - rate > max_drop:
            findings.append(Finding("acceptance", "regression", f"acceptance at position {pos} is {rate:.3f}, "
                                    f"{base - rate:.2f} below the healthy {base:.2f} (allowed {max_drop})"))
    if len(rates) != len(baseline):
        findings.append(Finding("acceptance", "harness", f"/metrics reports {len(rates)} draft positions, "
                                f"the baseline has {len(baseline)}"))
    return data, findings


def snapshot(ctx: StepContext, keep: Path) -> SpecCounters | None:
    """The spec-decode counters of ``/metrics`` now; the exposition as read is kept in ``keep``.

    A failed read is remembered in ``ctx.state`` and becomes the step's harness finding."""
    try:
        text = ctx.server.client.metrics_text()
        keep.write_text(text)
        return parse_counters(text)
    except (httpx.HTTPError, RegressError) as exc:
        ctx.state.setdefault("acceptance.errors", []).append(
            Finding("acceptance", "harness", f"reading /metrics: {exc}"))
        return None


def prepare(ctx: StepContext) -> None:
    """Before the first check: the counters the run's rates are measured from."""
    ctx.state["acceptance.before"] = snapshot(ctx, ctx.out_dir / "metrics-before.txt")


def step(ctx: StepContext) -> tuple[dict[str, Any], list[Finding]]:
    ctx.say("acceptance: reading /metrics")
    after = snapshot(ctx, ctx.out_dir / "metrics-after.txt")
    data, findings = judge(ctx.profile, ctx.state.get("acceptance.before"), after)
    return data, ctx.state.get("acceptance.errors") or findings


def summary(data: dict[str, Any]) -> str:
    return "per position " + ", ".join(f"{r:.2f}" for r in data.get("rates", []))
