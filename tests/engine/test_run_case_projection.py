"""An engine case's projection switch reaches the build under test: 0.28.0's series reads
``VLLM_DCP_PROJECT_BEFORE_MERGE``, 0.34.0's a ``ParallelConfig`` field, which ``run_case`` passes instead."""

from __future__ import annotations

import dataclasses

import pytest

from overlay.engine import run_case


@dataclasses.dataclass
class _OldArgs:  # an EngineArgs without the field (0.28.0's build)
    decode_context_parallel_size: int = 1


@dataclasses.dataclass
class _NewArgs:  # one with it
    decode_context_parallel_size: int = 1
    dcp_v_up_proj_before_merge: str = "auto"


def test_the_variable_becomes_the_field_where_the_build_has_it() -> None:
    env = {run_case.PROJECTION_ENV: "1"}
    assert run_case.projection_kwargs(_NewArgs, env) == {run_case.PROJECTION_FIELD: "on"}
    assert run_case.projection_kwargs(_NewArgs, {run_case.PROJECTION_ENV: "0"}) == {run_case.PROJECTION_FIELD: "off"}
    assert run_case.projection_kwargs(_OldArgs, env) == {}  # the build reads the variable itself
    assert run_case.projection_kwargs(_NewArgs, {}) == {}  # the case sets none: the build's default


def test_a_value_other_than_0_or_1_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^VLLM_DCP_PROJECT_BEFORE_MERGE='on': an engine case sets 0 or 1$"):
        run_case.projection_kwargs(_NewArgs, {run_case.PROJECTION_ENV: "on"})


def test_the_installed_builds_engine_args_take_what_is_passed() -> None:
    """On the installed build: the field, where its series has one, is an EngineArgs field whose values
    include both that are passed (the engine would refuse an unknown keyword)."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    fields = {f.name: f for f in dataclasses.fields(arg_utils.EngineArgs)}
    kwargs = run_case.projection_kwargs(arg_utils.EngineArgs, {run_case.PROJECTION_ENV: "1"})
    if run_case.PROJECTION_FIELD not in fields:
        assert kwargs == {}
        return
    config = pytest.importorskip("vllm.config")
    for value in ("on", "off"):
        parallel = config.ParallelConfig(**{run_case.PROJECTION_FIELD: value})
        assert getattr(parallel, run_case.PROJECTION_FIELD) == value
