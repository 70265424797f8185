"""The regression's errors: every one is a harness failure (exit 2) unless it says otherwise.

A regression (the build under test misbehaving) is never an exception: it is a finding in the
report and exit 1. These exceptions are for the harness not being able to do its job: a bad
profile, a server that never came up, a tool that is missing or crashed.
"""

from __future__ import annotations

from overlay.errors import OverlayError


class RegressError(OverlayError):
    """The harness itself failed; nothing can be concluded about the build (exit 2)."""

    exit_code = 2


class ProfileError(RegressError):
    """A profile is missing, is not valid YAML, or has a field that fails validation."""


class ServerDied(RegressError):
    """The server under test exited or stopped answering during a step.

    Raised inside the run and turned into a ``server-died`` finding (exit 1): a dead engine is
    the build failing (the seed's long-prefill crash), not the harness.
    """

    exit_code = 1

    def __init__(self, step: str, detail: str) -> None:
        self.step = step
        self.detail = detail
        super().__init__(f"server died during {step}: {detail}")
