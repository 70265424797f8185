"""Reading answers: the last integer, a consecutive count, and an n-gram repetition detector."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

_INT = re.compile(r"-?\d+")
_WORD = re.compile(r"\w+|[^\w\s]")


def last_int(text: str) -> int | None:
    found = _INT.findall(text)
    return int(found[-1]) if found else None


@dataclass(frozen=True)
class CountRun:
    consecutive: int      # how far 1, 2, 3, ... ran before the first wrong number
    broken: bool          # numbers went on after the run ended: a break, not a stop
    first_wrong: int | None

    def describe(self) -> str:
        if not self.broken:
            return f"1..{self.consecutive} consecutive"
        return f"1..{self.consecutive} consecutive, then {self.first_wrong}"


def count_run(text: str, start: int = 1) -> CountRun:
    numbers = [int(n) for n in _INT.findall(text)]
    # Tolerate a preamble number ("Counting from 1 to 200: 1 2 3 ..."): start at the first `start`.
    if start in numbers:
        numbers = numbers[numbers.index(start):]
    else:
        return CountRun(0, bool(numbers), numbers[0] if numbers else None)
    run = 0
    for n in numbers:
        if n != start + run:
            return CountRun(run, True, n)
        run += 1
    return CountRun(run, False, None)


@dataclass(frozen=True)
class Repetition:
    ngrams: int
    duplicate_ratio: float   # share of n-grams that repeat an earlier one
    top: str
    top_count: int

    def describe(self) -> str:
        return f"{self.duplicate_ratio:.0%} of {self.ngrams} word {len(self.top.split())}-grams repeat " \
               f"(most: {self.top!r} x{self.top_count})"


def repetition(text: str, n: int, min_ngrams: int = 16) -> Repetition:
    """Duplicate n-gram share; outputs too short to judge (< ``min_ngrams``) score 0."""
    words = [w.lower() for w in _WORD.findall(text) if w.strip()]
    grams = [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]
    if len(grams) < min_ngrams:
        return Repetition(len(grams), 0.0, "", 0)
    counts = Counter(grams)
    top, top_count = counts.most_common(1)[0]
    return Repetition(len(grams), 1 - len(counts) / len(grams), top, top_count)


def estimate_tokens(text: str) -> int:
    """A lower bound on BPE tokens: words and punctuation marks (BPE never merges across spaces)."""
    return len(_WORD.findall(text))
