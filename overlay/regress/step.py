"""What a check's step gets (:class:`StepContext`): the profile, the server, the run's folder and options.

Apart from the registry (:mod:`overlay.regress.checks`) so that the registry imports none of the modules
that read it: ``profiles`` reads the registry's thresholds, and this module reads ``profiles``, ``results``
and ``server``; the imports of ``overlay/regress/`` run one way (``tests/test_import_graph.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overlay.regress.profiles import Profile
from overlay.regress.results import Finding
from overlay.regress.server import Server


@dataclass
class StepContext:
    """What a check's step gets: the profile, the server, the run's folder and options, a progress line."""

    profile: Profile
    server: Server
    out_dir: Path
    say: Callable[[str], None]
    ref_url: str | None = None
    ref_file: str | None = None
    record_differential: str | None = None
    state: dict[str, Any] = field(default_factory=dict)  # what a check's prepare keeps for its step


StepFn = Callable[[StepContext], "tuple[dict[str, Any], list[Finding]]"]
