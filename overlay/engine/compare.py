"""Compare an engine case's outputs with the reference's, position by position, within a tolerance.

Prompt logprobs are compared at every prompt position. Decoding is compared step by step while
both runs share the same context: the reference's greedy token must be the case's too, and its
logprob (and that of every other top-5 token both runs list) must agree within the tolerance.
A different greedy token is accepted only where the reference itself was at a near tie (its
top-1 and the case's token within the tolerance); the contexts then differ and that request's
comparison stops there (``diverged_at``).

The tolerance is derived, not typed: ``derive_tolerance`` takes the largest deviation of the
DCP 1 spread runs from the DCP 1 reference (an identical rerun, and a rerun with another batch
composition and step size, which changes kernel tiling and reduction order but not the math:
the engine's own bf16/fp8 rounding) and multiplies it by ``SAFETY``, with ``FLOOR`` as the
least: bf16 keeps 8 significant bits, so a logit of magnitude ~8 (the generated checkpoint's
top logits) carries ~8 * 2**-8 = 0.03 of rounding, and a logprob (logit minus logsumexp) up to
about twice that. A wrong DCP merge moves logprobs by O(1) (the checkpoint is scaled for it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SAFETY = 3.0
FLOOR = 0.0625  # 2 * 8 * 2**-8: see the module docstring


@dataclass
class RequestDiff:
    prompt_len: int
    prompt_max_abs: float = 0.0
    prompt_worst_pos: int = -1
    prompt_missing: int = 0
    decode_max_abs: float = 0.0
    decode_worst_step: int = -1
    steps_compared: int = 0
    diverged_at: int | None = None
    tie_divergence: bool = False
    token_mismatch: str | None = None


@dataclass
class CaseDiff:
    requests: list[RequestDiff] = field(default_factory=list)

    @property
    def prompt_max_abs(self) -> float:
        return max((r.prompt_max_abs for r in self.requests), default=0.0)

    @property
    def decode_max_abs(self) -> float:
        return max((r.decode_max_abs for r in self.requests), default=0.0)

    @property
    def max_abs(self) -> float:
        return max(self.prompt_max_abs, self.decode_max_abs)

    def problems(self, tol: float) -> list[str]:
        """One line per reason this case does not match the reference within ``tol``."""
        out: list[str] = []
        for i, r in enumerate(self.requests):
            where = f"request {i} ({r.prompt_len}-token prompt)"
            if r.prompt_missing:
                out.append(f"{where}: {r.prompt_missing} prompt position(s) without a logprob")
            if r.prompt_max_abs > tol:
                out.append(f"{where}: prompt logprob off by {r.prompt_max_abs:.3g} at position "
                           f"{r.prompt_worst_pos} (tolerance {tol:.3g})")
            if r.token_mismatch:
                out.append(f"{where}: {r.token_mismatch}")
            if r.decode_max_abs > tol:
                out.append(f"{where}: decode logprob off by {r.decode_max_abs:.3g} at step "
                           f"{r.decode_worst_step} (tolerance {tol:.3g})")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_max_abs": self.prompt_max_abs, "decode_max_abs": self.decode_max_abs,
                "requests": [asdict(r) for r in self.requests]}


def _row_map(row: list[list[float]]) -> dict[int, float]:
    return {int(t): float(lp) for t, lp in row}


def compare(ref: dict[str, Any], got: dict[str, Any], tol: float) -> CaseDiff:
    """Position-by-position differences of ``got`` from ``ref`` (two ``run_case`` outputs)."""
    if len(ref["requests"]) != len(got["requests"]):
        raise ValueError(f"request count differs: {len(ref['requests'])} vs {len(got['requests'])}")
    diff = CaseDiff()
    for a, b in zip(ref["requests"], got["requests"], strict=True):
        if a["prompt_len"] != b["prompt_len"]:
            raise ValueError(f"prompt length differs: {a['prompt_len']} vs {b['prompt_len']}")
        r = RequestDiff(prompt_len=a["prompt_len"])
        for pos, (x, y) in enumerate(zip(a["prompt_logprobs"], b["prompt_logprobs"], strict=True)):
            if x is None and y is None:
                continue
            if x is None or y is None:
                r.prompt_missing += 1
                continue
            d = abs(x - y)
            if d > r.prompt_max_abs:
                r.prompt_max_abs, r.prompt_worst_pos = d, pos
        _compare_decode(a, b, tol, r)
        diff.requests.append(r)
    return diff


def _compare_decode(a: dict[str, Any], b: dict[str, Any], tol: float, r: RequestDiff) -> None:
    for step, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"], strict=False)):
        ra, rb = _row_map(a["top"][step]), _row_map(b["top"][step])
        for tok, lp in ra.items():
            if tok in rb:
                d = abs(lp - rb[tok])
                if d > r.decode_max_abs:
                    r.decode_max_abs, r.decode_worst_step = d, step
            elif tok == ta:
                r.token_mismatch = f"step {step}: the reference's token {ta} is not in the case's top-5"
                r.diverged_at = step
                return
        r.steps_compared = step + 1
        if ta != tb:
            r.diverged_at = step
            gap = ra[ta] - ra.get(tb, float("-inf"))
            if gap <= tol:
                r.tie_divergence = True
            else:
                r.token_mismatch = (f"step {step}: greedy token {tb} instead of {ta} "
                                    f"(reference margin {gap:.3g} > tolerance {tol:.3g})")
            return
    if len(a["tokens"]) != len(b["tokens"]) and r.diverged_at is None:
        r.token_mismatch = f"{len(b['tokens'])} tokens generated instead of {len(a['tokens'])}"


def derive_tolerance(ref: dict[str, Any], spreads: list[dict[str, Any]]) -> tuple[float, float]:
    """(tolerance, spread): ``max(SAFETY * spread, FLOOR)`` from the DCP 1 spread runs."""
    spread = 0.0
    for doc in spreads:
        spread = max(spread, compare(ref, doc, float("inf")).max_abs)
    return max(SAFETY * spread, FLOOR), spread
