"""The regression's checks, each registered once, in the order a run takes them.

A check is one :class:`Check` line in :data:`CHECKS`: its name (the word a profile's ``checks``,
``checks_off`` and ``--skip`` use), its title (the words the help, the README and the guides use),
the thresholds it reads (a profile must justify exactly those), whether a profile that names no
checks runs it, the profile section holding its options, and where its code lives: ``step`` (run it
against the server: ``(StepContext) -> (data, findings)``, :mod:`overlay.regress.step`), ``summary`` (its
result in one line),
``section`` (its part of ``report.md``) and, where it has them, ``plot`` (its PNG), ``record`` (the
baseline fields ``--record-baseline`` takes from it) and ``prepare`` (before any check runs). They
are ``module:function`` strings, imported when a run reaches them, so a profile loads without the
checks' dependencies.

The order of :data:`CHECKS` is the run's order: the differential check first (it needs the server
as it came up), then long context (a crash on a long prefill ends the run in minutes, not after
GSM8K), then GSM8K (corruption left behind by long prompts shows up there too), then latency, and
acceptance last: it reads the speculative-decoding counters over everything the run sent. The
report's sections and plots, the recorded baseline, ``overlay regress --help``, the check list of a
profile that names none and each threshold's range are derived from it;
``tests/regress/test_checks_registry.py`` holds the README, the guide (``docs/regress/README.md``), the
Makefile's help line, the architecture's module map, the profile's option sections and each shipped
profile's ``checks`` and ``checks_off`` to it.

Adding a check touches, besides its one line here:

- its module, with ``step`` and ``summary`` (and ``prepare`` where it has one), named in ``docs/ARCHITECTURE.md``'s
  Layout row ``overlay/regress/`` when it is a new one; ``plot`` and ``record``, where it has them, may
  live anywhere (the shipped checks keep them in ``plots.py`` and ``baseline_record.py``); its ``Finding`` and
  ``ensure_alive`` calls name the check by its ``name`` here (``regress-verdicts`` matches on it);
  ``record`` returns fields of a profile's ``baseline:`` section, as ``profiles._baseline`` reads them,
  and its sample run data goes in the registry test's ``RECORD_SAMPLES`` (both held there);
- its report section, a function in ``report.py`` named by ``section``;
- its thresholds, each declared in its line here with its range (:func:`rate`: in (0, 1], a share or
  a rate; :func:`above_zero`: any value > 0): a :class:`Bound` has no default range;
- its profile fields in ``profiles.py``: a ``*Spec`` dataclass, its :class:`Profile` field and its
  parser (named by ``options``), and the numbers it compares with in ``Baseline``;
- every shipped profile (``profiles/*.yaml``): the check in ``checks:`` (with each threshold's ``why``)
  or in ``checks_off:`` with why it is off there;
- the words that name the checks in order: the README's "regress a server (...)" row, the guide's
  numbered list, the Makefile's ``regress`` help line and the ``overlay/regress/`` row of
  ``docs/ARCHITECTURE.md``'s module map.

``tests/regress/test_checks_registry.py`` fails while one of these is missing or parts from this line,
the Layout row aside (``tests/test_package_layout.py`` holds that).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bound:
    """A threshold a check reads, with the range a profile's value must fall in: above 0, and at most
    ``high`` where it is set. No default: a threshold says its range where it is declared."""

    name: str
    high: float | None


def rate(name: str) -> Bound:
    """A share or a rate, in (0, 1]: above 1 it could never fire (``acceptance_near_one: 7`` turned the
    collapse rules off without a word)."""
    return Bound(name, 1)


def above_zero(name: str) -> Bound:
    """A count, a factor, a ratio to a baseline or an amount: any value > 0."""
    return Bound(name, None)


@dataclass(frozen=True)
class Check:
    name: str
    step: str  # "module:function", (StepContext) -> (data, findings)
    summary: str  # "module:function", (data) -> one line
    thresholds: tuple[Bound, ...]  # each with its range: rate(...) or above_zero(...)
    default: bool = True  # run by a profile that names no checks
    prepare: str | None = None  # "module:function", (StepContext) -> None, before the first check runs
    also_when: str | None = None  # a StepContext option that turns the check on although the profile has it off
    title: str = ""  # how the help, the README and the guides name it (default: the name)
    options: str | None = None  # the profile section (YAML key, Profile field) holding its options
    section: str | None = None  # "module:function", (data, image path | None) -> report.md lines
    plot: str | None = None  # "module:function", (Profile, data, png path) -> the path, or None: nothing to plot
    record: str | None = None  # "module:function", (data) -> the baseline fields --record-baseline takes

    @property
    def words(self) -> str:
        return self.title or self.name

    def wanted(self, checks: tuple[str, ...], ctx: object | None = None) -> bool:
        """Run it: the profile names it, or ``ctx`` (a :class:`overlay.regress.step.StepContext`) sets
        its ``also_when`` option."""
        return self.name in checks or bool(self.also_when and ctx is not None and getattr(ctx, self.also_when))


def function(ref: str) -> Callable[..., Any]:
    """``module:function`` -> the function (imported now)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


_R = "overlay.regress.report"
_P = "overlay.regress.plots"
_B = "overlay.regress.baseline_record"
CHECKS: tuple[Check, ...] = (
    Check("differential", "overlay.regress.differential:step", "overlay.regress.differential:summary",
          (above_zero("differential_safety"), above_zero("differential_floor_nats")),
          default=False,  # needs a reference: opt in
          also_when="record_differential", options="differential", section=f"{_R}:differential_section"),
    Check("long_context", "overlay.regress.longctx:step", "overlay.regress.longctx:summary",
          (above_zero("count_min_consecutive"), above_zero("repetition_ngram"), rate("repetition_max_ratio")),
          title="long context", options="long_context", section=f"{_R}:long_context_section"),
    Check("gsm8k", "overlay.regress.gsm8k:step", "overlay.regress.gsm8k:summary", (above_zero("gsm8k_max_stderrs"),),
          title="GSM8K", options="gsm8k", section=f"{_R}:gsm8k_section", plot=f"{_P}:gsm8k_plot",
          record=f"{_B}:gsm8k_values"),
    Check("latency", "overlay.regress.latency:step", "overlay.regress.latency:summary",
          (above_zero("ttft_max_ratio"), above_zero("tpot_max_ratio")), options="latency",
          section=f"{_R}:latency_section", plot=f"{_P}:latency_plot", record=f"{_B}:latency_values"),
    Check("acceptance", "overlay.regress.acceptance:step", "overlay.regress.acceptance:summary",
          (rate("acceptance_near_one"), rate("acceptance_cliff"), rate("acceptance_max_drop")),
          prepare="overlay.regress.acceptance:prepare", section=f"{_R}:acceptance_section",
          plot=f"{_P}:acceptance_plot", record=f"{_B}:acceptance_values"),
)
NAMES: tuple[str, ...] = tuple(c.name for c in CHECKS)
DEFAULTS: tuple[str, ...] = tuple(c.name for c in CHECKS if c.default)
THRESHOLDS: dict[str, tuple[str, ...]] = {c.name: tuple(b.name for b in c.thresholds) for c in CHECKS}
HIGH: dict[str, float | None] = {b.name: b.high for c in CHECKS for b in c.thresholds}  # threshold -> its upper bound
TITLES: tuple[str, ...] = tuple(c.words for c in CHECKS)
RECORDED: tuple[str, ...] = tuple(c.name for c in CHECKS if c.record)
