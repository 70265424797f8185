"""Which release the test environment holds: the installed vLLM's release (its public version)."""

from __future__ import annotations

import functools


@functools.cache
def installed_release() -> str | None:
    """The release of the vLLM this environment imports (its public version), or None without one."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm").split("+", 1)[0]
    except PackageNotFoundError:
        return None
