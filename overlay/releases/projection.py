"""The projection through ``W_UV`` before the DCP merge, spelled the way a build reads it.

Our two series switch it differently: 0.28.0's reads ``VLLM_DCP_PROJECT_BEFORE_MERGE`` (1 on, 0 off,
unset: on), 0.34.0's has ``ParallelConfig.dcp_v_up_proj_before_merge``, the engine argument
``--dcp-v-up-proj-before-merge auto|on|off`` (auto: upstream's policy, on over NCCL a2a). A build of a
bare release has neither. Which one a build has is a release fact read from its tree
(``ReleaseFacts.projection_switch``, ``derive.projection_switch``); the tools that set the switch (the
engine check's cases, bench-engine's two servers, a regress profile's server) say ``on`` / ``off`` /
``auto`` and get the build's own spelling here, so that no tool sets a variable a build ignores.
"""

from __future__ import annotations

from pathlib import Path

from overlay.errors import OverlayError
from overlay.releases import derive
from overlay.releases.derive import PROJECTION_ENV, PROJECTION_FIELD
from overlay.releases.source import open_tree

VALUES = ("on", "off", "auto")
ARGUMENT = "--" + PROJECTION_FIELD.replace("_", "-")
KINDS = ("argument", "env", None)


class ProjectionError(OverlayError):
    """A value the build cannot be given: one line naming the value, the build and its switch."""

    exit_code = 2


def describe(switch: str | None) -> str:
    """The switch for people (``make status``, ``REBASE.md``, an engine check's report)."""
    return {"argument": f"{ARGUMENT} auto|on|off (ParallelConfig.{PROJECTION_FIELD})",
            "env": f"{PROJECTION_ENV}=1|0 (unset: on)",
            None: "no switch (the release's own policy)"}[switch]


def _checked(switch: str | None, value: str, build: str) -> None:
    if switch not in KINDS:
        raise ProjectionError(f"{build}: unknown projection switch {switch!r} (expected argument, env or none)")
    if value not in VALUES:
        raise ProjectionError(f"projection {value!r}: expected one of {', '.join(VALUES)}")
    if switch is None and value != "auto":
        raise ProjectionError(f"{build} has no switch for the projection before the DCP merge (neither {ARGUMENT} "
                              f"nor {PROJECTION_ENV}): it cannot be turned {value}")


def server_settings(switch: str | None, value: str, build: str = "this build") -> tuple[list[str], dict[str, str]]:
    """(``vllm serve`` arguments, environment) that set the projection to ``value`` on a build with
    ``switch``. ``auto`` on a variable-switched build is the variable unset (its default, on)."""
    _checked(switch, value, build)
    if switch == "argument":
        return [ARGUMENT, value], {}
    if switch == "env" and value != "auto":
        return [], {PROJECTION_ENV: "1" if value == "on" else "0"}
    return [], {}


def engine_settings(switch: str | None, value: str, build: str = "this build") -> tuple[dict[str, str], dict[str, str]]:
    """(``EngineArgs`` keyword arguments, environment) for an in-process engine (``LLM(...)``)."""
    args, env = server_settings(switch, value, build)
    return ({PROJECTION_FIELD: value} if args else {}), env


def value_of_env(raw: str | None, where: str) -> str | None:
    """The value a ``VLLM_DCP_PROJECT_BEFORE_MERGE`` setting means (None: unset); one line naming ``where``
    for anything but 0 and 1."""
    if raw is None:
        return None
    if raw not in ("0", "1"):
        raise ProjectionError(f"{where}: {PROJECTION_ENV}={raw!r}: expected 0 (off) or 1 (on)")
    return "on" if raw == "1" else "off"


def folder_switch(folder: Path) -> tuple[str | None, str]:
    """The switch of the build whose ``vllm/`` lives in ``folder`` (an installed, staged or laid-out tree: what
    ``importlib.util.find_spec("vllm")`` finds, a bench's ``--b-tree``) and how a message names that build
    (``vllm 0.34.0 at FOLDER``), read from its files (:func:`derive.projection_switch`), nothing imported. One
    line for a folder whose tree cannot say."""
    tree = open_tree(folder)
    try:
        build = f"vllm {derive.release(tree)} at {folder}"
    except derive.Missing:
        build = f"the vllm at {folder}"
    try:
        return derive.projection_switch(tree), build
    except derive.Missing as exc:
        raise ProjectionError(f"{build}: cannot tell how it switches the projection before the DCP merge "
                              f"({exc})") from None
