"""``ReleaseFacts``: what the tools key by vLLM release, for one release's tree, and the one refusal of a
release they cannot describe.

:func:`release_facts` reads every fact from the tree (``derive``) and GLM-5's attention from ``table``; a
fact it cannot read makes :class:`ReleaseFactsError`, one line naming the tree, the release and each
missing fact. The engine check picks its cases by these facts, the GLM-5 path harness builds the attention
they name (:func:`glm5_path`), device staging and the rebase record them and refuse a release without them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from overlay.errors import OverlayError
from overlay.releases import derive, projection
from overlay.releases.source import Tree, open_tree
from overlay.releases.table import ATTENTION

TABLE = "overlay/releases/table.py:ATTENTION"


class ReleaseFactsError(OverlayError):
    """A release the facts cannot describe: one line naming what is missing."""

    exit_code = 2


@dataclass(frozen=True)
class Glm5Path:
    """The code GLM-5 runs on CUDA: the registry's model class, the attention it builds, its DCP entry."""

    model_class: str
    attention_module: str
    attention_class: str
    entry: str  # "forward_impl" | "sparse_indexer_and_attn"


@dataclass(frozen=True)
class ReleaseFacts:
    """One release, as the tools need it."""

    release: str
    glm5: Glm5Path
    runner: str  # GLM-5's default model runner on CUDA: "v1" | "v2"
    v1_runner: bool  # VLLM_USE_V2_MODEL_RUNNER=0 still selects Model Runner V1
    dcp_comm_backend: str  # what a GLM-5 user who names none gets
    dcp_q_replicate: bool | None  # likewise; None: the release has no dcp_q_replicate option
    dcp_defaults_by_model: bool  # GLM-5's config hook chooses them (set_dcp_defaults), not fixed defaults
    dcp_ops: str  # the module of the DCP ops (combine, direct workspaces)
    direct_a2a_default: bool | None  # VLLM_USE_DIRECT_DCP_A2A's default (None: on where symmetric memory serves)
    direct_a2a_switches: tuple[str, ...]  # the modules whose direct path VLLM_USE_DIRECT_DCP_A2A switches
    # how the build is told to project through W_UV before the DCP merge (overlay.releases.projection):
    # "argument" | "env" | None (no switch); None also in records written before the fact existed
    projection_switch: str | None = None

    @property
    def runs_v1_by_choice(self) -> bool:
        """Model Runner V2 by default, and V1 still to be chosen: the build runs its references on both."""
        return self.runner == "v2" and self.v1_runner

    def rows(self) -> list[tuple[str, str]]:
        """(fact, value) for people: the report of an engine check, ``REBASE.md``, ``make status``."""
        runner = {("v1", True): "V1", ("v1", False): "V1 (no V2)", ("v2", False): "V2 (V1 removed)",
                  ("v2", True): "V2 (V1 by VLLM_USE_V2_MODEL_RUNNER=0)"}[(self.runner, self.v1_runner)]
        replicate = "no such option" if self.dcp_q_replicate is None else str(self.dcp_q_replicate)
        direct = {None: "auto", True: "on", False: "off"}[self.direct_a2a_default]
        return [
            ("GLM-5's model class", self.glm5.model_class),
            ("its attention, DCP entry",
             f"{self.glm5.attention_module}.{self.glm5.attention_class}, {self.glm5.entry}"),
            ("default model runner", runner),
            ("GLM-5's DCP defaults", f"{self.dcp_comm_backend}, dcp_q_replicate {replicate} "
                                     f"({'GLM-5 config chooses' if self.dcp_defaults_by_model else 'fixed'})"),
            ("DCP ops", self.dcp_ops),
            ("VLLM_USE_DIRECT_DCP_A2A", f"default {direct}; switches {', '.join(self.direct_a2a_switches)}"),
            ("projection before the DCP merge", projection.describe(self.projection_switch)),
        ]

    def summary(self) -> str:
        """:meth:`rows` on one line."""
        return "; ".join(f"{k}: {v}" for k, v in self.rows())

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["direct_a2a_switches"] = list(self.direct_a2a_switches)
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ReleaseFacts:
        return cls(**{**doc, "glm5": Glm5Path(**doc["glm5"]),
                      "direct_a2a_switches": tuple(doc["direct_a2a_switches"])})


def _attention(tree: Tree, model_class: str) -> Glm5Path:
    entry = ATTENTION.get(model_class)
    if entry is None:
        raise derive.Missing(f"GLM-5 resolves to {model_class}, which {TABLE} does not describe (add its attention "
                             "class and DCP entry there, with the evidence)")
    for module, cls, method in ((entry.module, entry.cls, None), entry.defined):
        absent = derive.defines(tree, module, cls, method)
        if absent:
            raise derive.Missing(f"{TABLE}[{model_class}]: {absent}")
    return Glm5Path(model_class, entry.module, entry.cls, entry.entry)


def glm5_path(tree: Tree | Path) -> Glm5Path:
    """GLM-5's path in ``tree`` alone (what the GLM-5 path harness needs); refused as :func:`release_facts`."""
    tree = open_tree(tree) if isinstance(tree, Path) else tree
    return _gather(tree, {"GLM-5's path": lambda: _attention(tree, derive.model_class(tree))})["GLM-5's path"]


def release_facts(tree: Tree | Path) -> ReleaseFacts:
    """Every fact of the release in ``tree`` (a folder holding ``vllm/``, or a wheel)."""
    tree = open_tree(tree) if isinstance(tree, Path) else tree
    got = _gather(tree, {
        "the release": lambda: derive.release(tree),
        "GLM-5's path": lambda: _attention(tree, derive.model_class(tree)),
        "the default model runner": lambda: derive.runner(tree),
        "GLM-5's DCP defaults": lambda: derive.dcp_defaults(tree),
        "the DCP ops": lambda: derive.dcp_ops(tree),
        "the direct A2A switch's default": lambda: derive.env_default(tree, derive.DIRECT_A2A_ENV),
        "what the direct A2A switch turns off": lambda: derive.direct_a2a_switches(tree, derive.dcp_ops(tree)),
        "the projection's switch": lambda: derive.projection_switch(tree),
    })
    return ReleaseFacts(got["the release"], got["GLM-5's path"], *got["the default model runner"],
                        *got["GLM-5's DCP defaults"], got["the DCP ops"], got["the direct A2A switch's default"],
                        got["what the direct A2A switch turns off"], got["the projection's switch"])


def _gather(tree: Tree, facts: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Each of ``facts`` read; one error naming every one that is missing (each cause once)."""
    got: dict[str, Any] = {}
    missing: list[str] = []
    for what, fact in facts.items():
        try:
            got[what] = fact()
        except derive.Missing as exc:
            if not any(str(exc) in m for m in missing):
                missing.append(f"{what}: {exc}")
    if missing:
        try:
            release = f"vllm {derive.release(tree)}"
        except derive.Missing:
            release = "no release"
        raise ReleaseFactsError(f"{tree.where}: {release}: the release facts cannot describe it: "
                                + "; ".join(missing))
    return got
