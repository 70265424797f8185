"""Every shipped profile's server arguments pass the installed release's own start-up checks (the default
release's: ``make test`` runs on its build), as far as a CPU allows.

A profile that cannot start must fail ``make test``, not the user's 8xH100 run. For each shipped
profile the ``vllm serve`` arguments go through vLLM's own CLI parser (``make_arg_parser``,
``validate_parsed_serve_args``), ``AsyncEngineArgs.from_cli_args`` and
``create_engine_config`` (model, parallel, cache, scheduler and speculative configs, with their
validation), against a local GLM-5-architecture ``config.json`` with an MTP layer in place of
the profile's checkpoint (no hub, no weights). Only the tool-call and reasoning parsers, which
need the real tokenizer's special tokens, are left out of the engine config once the CLI
validated them.

One start-up failure happens after the configs, when the drafter loads: vLLM 0.28.0's proposer
reads the draft model's ``mask_hidden`` buffer for ``parallel_drafting``
(``vllm/v1/spec_decode/llm_base_proposer.py``), which only EAGLE-3 / PARD-style drafters define;
``DeepSeekMTP`` has none ("'DeepSeekMTP' object has no attribute 'mask_hidden'", two H200s,
2026-11-30). That is checked on the draft model class the registry resolves.

The environment is checked too: every ``VLLM_*`` variable a profile's ``server.env`` sets must be one the
installed release reads (``vllm.envs.environment_variables``). vLLM only logs "Unknown vLLM environment
variable detected" for one it does not know and starts without it, so a profile setting 0.28.0's
``VLLM_DCP_PROJECT_BEFORE_MERGE`` on 0.34.0 would silently not run what it says (``make regress`` stops such a
launched server at run time: ``overlay/regress/runner.py``).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from overlay.engine.checkpoint import TinyGlm5Spec, write_config_only
from overlay.regress.profiles import load_profile, shipped_profiles
from tests.releasekit import installed_release

# Flags whose objects need the real tokenizer's special tokens (checked by the CLI only).
TOKENIZER_BOUND = {"--enable-auto-tool-choice": 0, "--tool-call-parser": 1, "--reasoning-parser": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GLM-5's architecture with one MTP layer, 64 heads (TP8 divides them) and its 202752 positions."""
    spec = TinyGlm5Spec(tp=8, heads_per_rank=8, max_position_embeddings=202752, num_nextn_predict_layers=1)
    return write_config_only(tmp_path_factory.mktemp("glm5-standin") / "model", spec)


@pytest.fixture(autouse=True)
def cpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM infers the device from the platform; this machine has no GPU: call it a CPU."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "cpu", raising=False)


def _without_tokenizer_bound(args: list[str]) -> list[str]:
    out, skip = [], 0
    for arg in args:
        if skip:
            skip -= 1
            continue
        flag = arg.split("=", 1)[0]
        if flag in TOKENIZER_BOUND:
            skip = 0 if "=" in arg else TOKENIZER_BOUND[flag]
            continue
        out.append(arg)
    return out


def _cli_args() -> Any:
    """The module of ``vllm serve``'s parser in the installed release (it moved: found in the tree, not by
    version)."""
    import importlib
    import importlib.util

    for name in ("vllm.entrypoints.openai.cli_args", "vllm.entrypoints.common.cli_args"):
        if importlib.util.find_spec(name) is not None:
            return importlib.import_module(name)
    raise LookupError("no vllm serve argument parser module (make_arg_parser) in the installed vLLM")


def engine_config(args: list[str], model: Path) -> Any:
    """vLLM's own parsing and config validation of ``vllm serve <model> <args>``."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_args = _cli_args()
    make_arg_parser, validate_parsed_serve_args = cli_args.make_arg_parser, cli_args.validate_parsed_serve_args

    parser = make_arg_parser(FlexibleArgumentParser())
    validate_parsed_serve_args(parser.parse_args([str(model), "--model", str(model), *args]))
    ns = parser.parse_args([str(model), "--model", str(model), *_without_tokenizer_bound(args)])
    return AsyncEngineArgs.from_cli_args(ns).create_engine_config()


def drafter_problem(vllm_config: Any) -> str | None:
    """Why the drafter of this config stops vLLM 0.28.0 at start-up, or None."""
    spec = vllm_config.speculative_config
    if spec is None or not spec.parallel_drafting:
        return None
    from vllm.model_executor.models import ModelRegistry

    draft = spec.draft_model_config
    cls, _ = ModelRegistry.resolve_model_cls(draft.architectures, model_config=draft)
    sources = "".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("vllm."))
    if "mask_hidden" not in sources:
        return (f"parallel_drafting with {cls.__name__}: vLLM 0.28.0's drafter reads the draft model's "
                "mask_hidden, which it does not have")
    return None


@pytest.mark.parametrize("name", shipped_profiles())
def test_shipped_profile_starts_as_far_as_a_cpu_allows(name: str, model_dir: Path) -> None:
    profile = load_profile(name)
    config = engine_config(list(profile.server.args), model_dir)
    assert config.parallel_config.tensor_parallel_size == int(profile.server.arg_value("--tensor-parallel-size"))
    if profile.server.speculative_config:
        assert config.speculative_config is not None
        assert config.speculative_config.num_speculative_tokens == profile.server.speculative_tokens
    projection = profile.server.arg_value("--dcp-v-up-proj-before-merge")
    if projection is not None:  # the engine argument of our 0.34.0 series: it must reach ParallelConfig
        assert config.parallel_config.dcp_v_up_proj_before_merge == projection
    assert drafter_problem(config) is None


def unread_variables(env: dict[str, str]) -> list[str]:
    """The ``VLLM_*`` names of ``env`` that the installed vLLM does not read (it would log each as unknown)."""
    from vllm import envs

    return sorted(name for name in env if name.startswith("VLLM_") and name not in envs.environment_variables)


@pytest.mark.parametrize("name", shipped_profiles())
def test_shipped_profile_env_is_read_by_the_installed_vllm(name: str) -> None:
    profile = load_profile(name)
    unread = unread_variables(profile.server.env)
    assert not unread, "; ".join(
        f"{profile.path}: server.env.{var}: the installed vLLM {installed_release()} does not read it (not in "
        "vllm.envs.environment_variables; it logs 'Unknown vLLM environment variable detected' and starts "
        "without it)" for var in unread)


def test_an_unread_variable_is_found() -> None:
    """The check above can fail: a name no release reads is found, one the release reads is not."""
    assert unread_variables({"VLLM_NO_SUCH_SWITCH": "1", "VLLM_USE_DIRECT_DCP_A2A": "1", "NCCL_NVLS_ENABLE": "0"}) == [
        "VLLM_NO_SUCH_SWITCH"]


def test_parallel_drafting_with_mtp_is_refused(model_dir: Path) -> None:
    """The check catches what stopped the report's setup on the 0.28.0 engine (its drafter has no
    ``mask_hidden``); later releases refuse it in the speculative config itself (0.34.0: parallel drafting
    is only for the dflash and dspark methods). Either way a profile asking for it fails here."""
    args = ["--tensor-parallel-size", "8", "--decode-context-parallel-size", "4", "--kv-cache-dtype", "fp8_ds_mla",
            "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 5, "parallel_drafting": true}']
    try:
        problem = drafter_problem(engine_config(args, model_dir))
    except ValueError as exc:  # pydantic's ValidationError is one
        problem = str(exc)
    assert problem is not None and ("mask_hidden" in problem or "parallel_drafting is only supported" in problem)


def test_an_unknown_flag_fails_the_cli(model_dir: Path) -> None:
    with pytest.raises(SystemExit):
        engine_config(["--tensor-paralel-size", "8"], model_dir)
