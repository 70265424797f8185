"""Versions resolved in place of exact pins a release makes and the package index does not serve.

vLLM 0.34.0 pins ``flashinfer-python==0.7.3``, a version PyPI never had (it has 0.7.2.post1 and
0.7.4). Every resolution of a release's requirements meets that pin: the rebase's test environments
(:mod:`overlay.maintain.rebase.deps`) and the device staging (:mod:`overlay.device.staging`). Both ask
this table, so a stand-in is named once, with its evidence, and each run says when it swapped one.
An exact pin the index lacks and the table does not name stays an error that names this table.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

TABLE = "overlay/build/stand_ins.py:VERSION_STAND_INS"
"""Where a missing stand-in is added, as error messages name it."""


@dataclass(frozen=True)
class VersionStandIn:
    """A version resolved in place of one the release pins exactly and the index does not serve."""

    version: str
    evidence: str


VERSION_STAND_INS: dict[tuple[str, str], VersionStandIn] = {
    ("flashinfer-python", "0.7.3"): VersionStandIn(
        "0.7.4", "vLLM 0.34.0 requires flashinfer-python==0.7.3 (its requirements/cuda.txt), which PyPI does "
                 "not serve (pip index versions, 2026-12-05: 0.7.2.post1, then 0.7.4); 0.7.4 is the next release "
                 "it serves (on CPU the tests only import it: no flashinfer kernel runs there; on a GPU a run "
                 "with it is a run with 0.7.4, which its record says)"),
}
"""(canonical name, the release's exact pin) -> the version resolved instead."""


def exact_pin(req: Requirement) -> str | None:
    """The version of ``name==X``, else None."""
    specs = list(req.specifier)
    if len(specs) == 1 and specs[0].operator in ("==", "===") and "*" not in specs[0].version:
        return specs[0].version
    return None


def stand_in_for(req: Requirement) -> VersionStandIn | None:
    """The stand-in :data:`VERSION_STAND_INS` names for ``req``'s exact pin, else None."""
    return VERSION_STAND_INS.get((canonicalize_name(req.name), exact_pin(req) or ""))


def stand_in_version(req: Requirement) -> str:
    """``req`` as a resolution asks for it: an exact pin :data:`VERSION_STAND_INS` names at its
    stand-in version (extras and markers kept), any other as written."""
    found = stand_in_for(req)
    if found is None:
        return str(req)
    swapped = Requirement(str(req))
    swapped.specifier = SpecifierSet(f"=={found.version}")
    return str(swapped)


def swap_all(requirements: list[str]) -> tuple[list[str], list[str]]:
    """``requirements`` with every named pin at its stand-in, and one line per swap saying what and why."""
    out: list[str] = []
    said: list[str] = []
    for text in requirements:
        req = Requirement(text)
        out.append(stand_in_version(req))
        found = stand_in_for(req)
        if found is not None:
            said.append(f"{text} resolved as {out[-1]} ({TABLE}: {found.evidence})")
    return out, said
