"""Where vLLM symbols live, per release, so a patch's tests can run on other releases.

Tests ask ``compat.module("dcp")`` instead of importing ``vllm.v1.attention.ops.dcp_utils``
directly; the rebase tool runs a patch's own tests against a newer base to find out whether
upstream absorbed the fix in its own way (0.29.0 renamed ``dcp_utils.py`` to ``ops/dcp.py``).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from packaging.version import Version

# logical name -> [(first release with this location, module path)], newest last.
LOCATIONS: dict[str, list[tuple[str, str]]] = {
    "dcp": [("0.28.0", "vllm.v1.attention.ops.dcp_utils"), ("0.29.0", "vllm.v1.attention.ops.dcp")],
    "dcp_alltoall": [("0.28.0", "vllm.v1.attention.ops.dcp_alltoall"), ("0.29.0", "vllm.v1.attention.ops.dcp")],
    "ops_common": [("0.28.0", "vllm.v1.attention.ops.common"), ("0.29.0", "vllm.v1.attention.ops.dcp")],
    "mla_attention": [("0.28.0", "vllm.model_executor.layers.attention.mla_attention")],
    "flashmla_sparse": [("0.28.0", "vllm.v1.attention.backends.mla.flashmla_sparse")],
    "flashinfer_mla_sparse": [("0.28.0", "vllm.v1.attention.backends.mla.flashinfer_mla_sparse")],
    "cp_utils": [("0.28.0", "vllm.v1.worker.cp_utils")],
    "sparse_utils": [("0.28.0", "vllm.v1.attention.backends.mla.sparse_utils")],
    "attention_layer_base": [("0.28.0", "vllm.model_executor.layers.attention_layer_base")],
    "gpu_model_runner": [("0.28.0", "vllm.v1.worker.gpu_model_runner")],
    "eagle": [("0.28.0", "vllm.v1.spec_decode.eagle")],
    # symmetric-memory probing and the direct workspaces' base class (0.29.0 split them out)
    "cp_common": [("0.28.0", "vllm.v1.attention.ops.dcp_utils"), ("0.29.0", "vllm.v1.attention.ops.cp_common")],
}

# logical symbol -> [(first release, logical module, attribute)], newest last: for symbols
# that were renamed, not only moved.
SYMBOLS: dict[str, list[tuple[str, str, str]]] = {
    "direct_workspace": [("0.28.0", "dcp", "_DirectDCPWorkspace"), ("0.29.0", "cp_common", "DirectCPWorkspace")],
}


# logical name -> [(first release, attribute name)], newest last: names that tests compare
# against recorded call names (methods renamed without moving).
NAMES: dict[str, list[tuple[str, str]]] = {
    "combine_direct_a2a": [("0.28.0", "_combine_direct_a2a"), ("0.29.0", "_direct_workspace_combine")],
}


def vllm_version() -> Version:
    """The release of the vLLM being tested (local label dropped)."""
    import vllm

    return Version(Version(vllm.__version__).base_version)


def _newest(table: dict[str, list[tuple[Any, ...]]], key: str, version: Version | None) -> tuple[Any, ...]:
    """The entry of ``table[key]`` (``(first release, ...)`` rows, oldest first) in force at ``version``."""
    version = version or vllm_version()
    rows = [row[1:] for row in table[key] if Version(row[0]) <= version]
    if not rows:
        raise LookupError(f"{key!r} has no known location in vllm {version}")
    return rows[-1]


def module_path(name: str, version: Version | None = None) -> str:
    """The module path of logical ``name`` in ``version`` (default: the imported vLLM)."""
    return _newest(LOCATIONS, name, version)[0]


def module(name: str) -> ModuleType:
    """Import logical module ``name`` for the vLLM under test."""
    return importlib.import_module(module_path(name))


def symbol(name: str, attr: str) -> object:
    """``getattr(module(name), attr)``."""
    return getattr(module(name), attr)


def renamed(name: str, version: Version | None = None) -> object:
    """The object that logical symbol ``name`` (see ``SYMBOLS``) is in the vLLM under test."""
    version = version or vllm_version()
    mod, attr = _newest(SYMBOLS, name, version)
    return getattr(importlib.import_module(module_path(mod, version)), attr)


def name(key: str, version: Version | None = None) -> str:
    """The attribute name logical ``key`` (see ``NAMES``) has in the vLLM under test."""
    return _newest(NAMES, key, version)[0]
