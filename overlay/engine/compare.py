"""Compare an engine case's outputs with the reference's, position by position, within a tolerance.

Every logprob is predicted from a context: prompt position ``p`` from the ``p`` tokens before
it, decode step ``j`` from ``prompt_len + j``. Where the context holds at most ``index_topk``
tokens the DSA indexer selects every token, so attention is dense and two runs of the same
math differ by rounding only: there every logprob is held to ``Tolerance.dense``. Beyond
``index_topk`` the indexer's top-k is a hard selection, and rounding noise swaps tokens at its
boundary (measured on two H200s: two DCP 1 runs that differ only in batch composition agree
bit for bit up to position 2048 of a 9000-token prompt and by up to 3 nats beyond), so there the
*distribution* of the deviations is held to the spread's (its median and 90th percentile), not
each one: a wrong merge or a wrong top-k moves the whole distribution.

Decoding is compared step by step while both runs share the context: in the dense region the
reference's greedy token must be the case's too unless the reference was at a near tie (its
top-1 and the case's token within the dense tolerance), and its logprob (and that of every
other top-5 token both runs list) must agree within the tolerance; a different token ends that
request's comparison (``diverged_at``). In the sparse region decode deviations join the
distribution and a different token only ends the comparison.

The tolerance is derived, not typed (``derive_tolerance``): ``SAFETY`` x the largest dense
deviation, and ``SAFETY`` x the median and 90th percentile of the sparse deviations, of the
DCP 1 spread runs from the DCP 1 reference (an identical rerun; a rerun with another batch
composition and step size: the engine's own bf16/fp8 rounding, same math), each at least
``FLOOR``: bf16 keeps 8 significant bits, so a logit of magnitude ~8 (the generated
checkpoint's top logits) carries ~8 * 2**-8 = 0.03 of rounding, and a logprob (logit minus
logsumexp) up to about twice that.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SAFETY = 3.0
FLOOR = 0.0625  # 2 * 8 * 2**-8: see the module docstring
INDEX_TOPK = 2048  # the generated checkpoint's (GLM-5's) index_topk


@dataclass(frozen=True)
class Tolerance:
    """Largest dense deviation; largest median and 90th percentile of the sparse deviations (nats)."""

    dense: float = FLOOR
    sparse_q50: float = FLOOR
    sparse_q90: float = FLOOR

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class RequestDiff:
    prompt_len: int
    dense_max_abs: float = 0.0
    dense_worst: str = ""
    missing: int = 0
    steps_compared: int = 0
    diverged_at: int | None = None
    tie_divergence: bool = False
    token_mismatch: str | None = None
    sparse: list[float] = field(default_factory=list, repr=False)

    def _dense(self, d: float, where: str) -> None:
        if d > self.dense_max_abs:
            self.dense_max_abs, self.dense_worst = d, where

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("sparse")
        out |= {"sparse_n": len(self.sparse), "sparse_q50": _quantile(self.sparse, 0.5),
                "sparse_q90": _quantile(self.sparse, 0.9), "sparse_max": max(self.sparse, default=0.0)}
        return out


@dataclass
class CaseDiff:
    requests: list[RequestDiff] = field(default_factory=list)

    @property
    def dense_max_abs(self) -> float:
        return max((r.dense_max_abs for r in self.requests), default=0.0)

    @property
    def sparse(self) -> list[float]:
        return [d for r in self.requests for d in r.sparse]

    @property
    def sparse_q50(self) -> float:
        return _quantile(self.sparse, 0.5)

    @property
    def sparse_q90(self) -> float:
        return _quantile(self.sparse, 0.9)

    def problems(self, tol: Tolerance) -> list[str]:
        """One line per reason this case does not match the reference within ``tol``."""
        out: list[str] = []
        for i, r in enumerate(self.requests):
            where = f"request {i} ({r.prompt_len}-token prompt)"
            if r.missing:
                out.append(f"{where}: {r.missing} position(s) without a logprob")
            if r.dense_max_abs > tol.dense:
                out.append(f"{where}: logprob off by {r.dense_max_abs:.3g} at {r.dense_worst} "
                           f"(dense tolerance {tol.dense:.3g})")
            if r.token_mismatch:
                out.append(f"{where}: {r.token_mismatch}")
        if self.sparse_q50 > tol.sparse_q50:
            out.append(f"beyond index_topk: median deviation {self.sparse_q50:.3g} > {tol.sparse_q50:.3g}")
        if self.sparse_q90 > tol.sparse_q90:
            out.append(f"beyond index_topk: 90th-percentile deviation {self.sparse_q90:.3g} > {tol.sparse_q90:.3g}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"dense_max_abs": self.dense_max_abs, "sparse_q50": self.sparse_q50, "sparse_q90": self.sparse_q90,
                "sparse_max": max(self.sparse, default=0.0), "sparse_n": len(self.sparse),
                "requests": [r.to_dict() for r in self.requests]}


def _row_map(row: list[list[float]]) -> dict[int, float]:
    return {int(t): float(lp) for t, lp in row}


def compare(ref: dict[str, Any], got: dict[str, Any], tol: Tolerance, index_topk: int = INDEX_TOPK) -> CaseDiff:
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
                r.missing += 1
                continue
            d = abs(x - y)
            if pos <= index_topk:
                r._dense(d, f"prompt position {pos}")
            else:
                r.sparse.append(d)
        _compare_decode(a, b, tol, r, index_topk)
        diff.requests.append(r)
    return diff


def _compare_decode(a: dict[str, Any], b: dict[str, Any], tol: Tolerance, r: RequestDiff, index_topk: int) -> None:
    for step, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"], strict=False)):
        dense = a["prompt_len"] + step <= index_topk
        ra, rb = _row_map(a["top"][step]), _row_map(b["top"][step])
        for tok, lp in ra.items():
            if tok in rb:
                d = abs(lp - rb[tok])
                if dense:
                    r._dense(d, f"decode step {step}")
                else:
                    r.sparse.append(d)
            elif tok == ta and dense:
                r.token_mismatch = f"decode step {step}: the reference's token {ta} is not in the case's top-5"
                r.diverged_at = step
                return
        r.steps_compared = step + 1
        if ta != tb:
            r.diverged_at = step
            gap = ra[ta] - ra.get(tb, float("-inf"))
            if not dense or gap <= tol.dense:
                r.tie_divergence = dense
            else:
                r.token_mismatch = (f"decode step {step}: greedy token {tb} instead of {ta} "
                                    f"(reference margin {gap:.3g} > tolerance {tol.dense:.3g})")
            return
    if len(a["tokens"]) != len(b["tokens"]) and r.diverged_at is None:
        r.token_mismatch = f"{len(b['tokens'])} tokens generated instead of {len(a['tokens'])}"


def derive_tolerance(ref: dict[str, Any], spreads: list[dict[str, Any]], index_topk: int = INDEX_TOPK, *,
                     safety: float = SAFETY, floor: float = FLOOR) -> tuple[Tolerance, dict[str, float]]:
    """The tolerance from the spread runs (``safety`` x their deviation, at least ``floor``), and the spread."""
    loose = Tolerance(float("inf"), float("inf"), float("inf"))
    dense, q50, q90 = 0.0, 0.0, 0.0
    for doc in spreads:
        d = compare(ref, doc, loose, index_topk)
        dense, q50, q90 = max(dense, d.dense_max_abs), max(q50, d.sparse_q50), max(q90, d.sparse_q90)
    spread = {"dense_max_abs": dense, "sparse_q50": q50, "sparse_q90": q90}
    return Tolerance(max(safety * dense, floor), max(safety * q50, floor), max(safety * q90, floor)), spread
