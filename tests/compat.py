"""Where vLLM symbols live, per release, so a patch's tests can run on other releases; and which
part of a test is its harness and which the behaviour it judges.

Tests ask ``compat.module("dcp")`` instead of importing ``vllm.v1.attention.ops.dcp_utils``
directly; the rebase tool runs a patch's own tests against a newer base to find out whether
upstream absorbed the fix in its own way (0.29.0 renamed ``dcp_utils.py`` to ``ops/dcp.py``).

A failure there means something only when it is about the behaviour. ``with compat.setup(what):``
marks harness code that calls into vLLM (building configs, metadata, stand-ins): whatever it
raises is a :class:`HarnessError`, and the test "cannot run" on that release.
``with compat.exercising(what):`` marks a call of the code under test whose raising is the
failure the test is about (:class:`BehaviourFailure`); :func:`added` looks up a name the patch
adds, whose absence is such a failure. ``overlay/maintain/rebase/failkind.py`` reads the two classes'
``overlay_failure`` and judges unmarked failures by where they were raised.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
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
    "gpu_model_runner_v2": [("0.28.0", "vllm.v1.worker.gpu.model_runner")],  # Model Runner V2
    "vllm_config": [("0.28.0", "vllm.config.vllm")],
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


class HarnessError(RuntimeError):
    """The test's own setup failed on the vLLM under test: it judged nothing there."""

    overlay_failure = "harness"


class BehaviourFailure(AssertionError):
    """The code under test raised where the test requires it to work."""

    overlay_failure = "behaviour"


class OffModelPath(BehaviourFailure):
    """The patch is there, but the path the model runs does not take it (the GLM-5 path harness,
    ``tests/patches/glm5_path.py``): a behaviour failure that ``make rebase`` and the matrix also name
    as "off the model's path"."""

    overlay_failure = "off-path"


@contextmanager
def _region(what: str, error: type[Exception]) -> Iterator[None]:
    try:
        yield
    except (HarnessError, BehaviourFailure):
        raise  # an inner region already said what it is
    except Exception as exc:
        raise error(f"{what}: {type(exc).__name__}: {exc}") from exc


def setup(what: str) -> AbstractContextManager[None]:
    """Harness code calling into vLLM: anything it raises is a :class:`HarnessError` about ``what``."""
    return _region(what, HarnessError)


def exercising(what: str) -> AbstractContextManager[None]:
    """The code under test runs here: anything it raises is a :class:`BehaviourFailure`."""
    return _region(what, BehaviourFailure)


def added(owner: str | object, attr: str) -> Any:
    """``owner.attr`` for a name the patch adds (``owner``: a logical module name, or any object): its
    absence is a behaviour failure, not a harness error."""
    where = (module_path(owner) if isinstance(owner, str)
             else owner.__name__ if isinstance(owner, type) else type(owner).__name__)
    with exercising(f"{where}.{attr}, which the patch adds"):
        return getattr(module(owner) if isinstance(owner, str) else owner, attr)
